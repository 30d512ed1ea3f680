"""Tensor parallelism: rank 0 (the engine thread) keeps the API, scheduler, caches' bookkeeping, sampler and
proposers, and sends each step's inputs to the worker ranks, processes it spawns on its host (and that `tokenmill
serve --node-rank K` spawns on host K, with --nnodes); every rank holds its shard of the weights
(parallel/sharding.py) and its own KV pool of the same blocks, runs the step, and all-reduces its partial sums
(parallel/collectives.py); rank 0 gathers the head's columns.

A worker that dies makes rank 0's collectives fail at once (the monitor thread sets the group's abort code) and
`failure` says which rank: the engine ends, and the server with it. A worker whose rank 0 is gone exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from tokenmill import backend, kernels
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.cache.sizing import build_kv_cache
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.layers import kv_quant
from tokenmill.layers.attention import AttentionMetadata, PagedMetadata
from tokenmill.loader import LoadedModel, load_model, read_config
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.parallel.collectives import Group, GroupSpec, agree_min, join, new_spec
from tokenmill.parallel.layers import all_reduce_partial_sums
from tokenmill.parallel.sharding import Shard, check_shardable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker that has not loaded its shard in this long stops the start


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group is gone or hangs: the engine cannot run another step."""


def rank_threads(config: EngineConfig) -> int:
    """Each rank's threads: --threads, or the CPUs this process may use split among its host's ranks."""
    return config.threads or max(1, len(os.sched_getaffinity(0)) // local_ranks(config))


def local_ranks(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def group_spec(config: EngineConfig, shm: bool) -> GroupSpec:
    """Shared memory on one host (where asked and possible); torch.distributed between hosts."""
    one_host = config.nnodes == 1
    return new_spec(config.tensor_parallel_size, shm and one_host and config.tp_shared_memory, config.master_addr,
                    config.master_port)


def rank_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """Where ranks are started from: a fork server that imported torch and this module once, so that a rank starts
    in milliseconds, not in the seconds of importing them again (3.5 s each on a 2-core Zen 3). It is a fresh
    process, not a fork of this one: no CUDA context or OpenMP threads of ours are copied into the ranks. Where
    there is none (Windows), a fresh interpreter per rank."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts, on the first ranks' start
    return ctx


def spawn_ranks(config: EngineConfig, spec: GroupSpec,
                ranks: range) -> tuple[list[Connection], list[multiprocessing.process.BaseProcess]]:
    ctx = rank_context()
    conns: list[Connection] = []
    workers: list[multiprocessing.process.BaseProcess] = []
    for rank in ranks:
        ours, theirs = ctx.Pipe()
        worker = ctx.Process(target=run_worker, name=f"tokenmill-rank-{rank}", daemon=True,
                             args=(config, spec, rank, theirs, logging.getLogger().level, dict(os.environ)))
        worker.start()
        theirs.close()  # the child's end: once it exits, reading ours says so (EOFError)
        conns.append(ours)
        workers.append(worker)
    return conns, workers


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The CPU, or on CUDA the host's GPU of this rank's place on its host (several ranks share a GPU where there are
    fewer GPUs than ranks, and then sum through gloo: NCCL refuses two ranks of one GPU)."""
    device = backend.resolve_device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % local_ranks(config) % backend.gpu_count())


def shares_gpus(config: EngineConfig) -> bool:
    return 0 < backend.gpu_count() < local_ranks(config)


def load_shard(config: EngineConfig, rank: int) -> LoadedModel:
    plan = dataclasses.replace(config.weight_plan(), device=str(rank_device(config, rank)))
    return load_model(config.model, plan, config.max_model_len, past_trained_context=config.allow_long_max_model_len,
                      shard=Shard(rank, config.tensor_parallel_size))


def kv_spec(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> KVSpec:
    """What one token's KV is made of, for the model as loaded (a rank's: its KV heads) and --kv-cache-dtype."""
    mc = loaded.config
    dtype = kv_quant.KV_CACHE_DTYPES[kv_cache_dtype] or loaded.dtype
    if dtype == torch.float8_e4m3fn and not backend.fp8_kv_runs(loaded.device):
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} on this GPU: its kernels convert e4m3 on sm_89 or newer "
                          "(Ada, Hopper and later); int8 runs on any")
    return KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, mc.sliding_layers, mc.sliding_window)


class ShardedModel:
    """Rank 0's model: each call runs on every rank (the workers are sent its inputs first)."""

    def __init__(self, model: LlamaForCausalLM, group: Group, vocab_size: int) -> None:
        self.model = model
        self.group = group
        self.widths = Shard(0, group.size).widths(vocab_size)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata), "EngineConfig.check() refuses --kv contiguous with tensor parallelism"
        self.group.send(("forward", input_ids.cpu().numpy(), positions.cpu().numpy(), _meta_to_wire(meta)))
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.send(("logits", _tensor_to_wire(hidden)))
        logits = self.group.gather_columns(self.model.compute_logits(hidden), self.widths)
        assert logits is not None
        return logits


class TensorParallel:
    """Rank 0's handle on the group: its workers, the group, and what went wrong (failure)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        size = config.tensor_parallel_size
        device = rank_device(config, 0)
        self.spec = group_spec(config, device.type == "cpu" and backend.cpu_kernels(device))
        self.conns, self.workers = spawn_ranks(config, self.spec, range(1, local_ranks(config)))
        self.failure: str | None = None
        self._closed = False
        try:
            self.group = join(self.spec, 0, device, shares_gpus(config))
        except BaseException:
            self._stop_workers(graceful=False)
            raise
        log.info("tensor parallelism: %d ranks, %d on this host, %d threads each, all-reduce through %s", size,
                 local_ranks(config), rank_threads(config),
                 "shared memory" if self.spec.shm_path else "torch.distributed")

    def describe(self) -> dict[str, object]:
        """For the dashboard: the ranks, each one's process and whether it is up, and what carries the sums."""
        ranks: list[dict[str, object]] = [{"rank": 0, "pid": os.getpid(), "up": self.failure is None}]
        ranks += [{"rank": r, "pid": w.pid, "up": w.is_alive()} for r, w in enumerate(self.workers, start=1)]
        return {"size": self.config.tensor_parallel_size, "ranks": ranks,
                "collectives": "shared memory" if self.spec.shm_path else "torch.distributed"}

    def wait_for(self, stage: str) -> None:
        """Every worker's report of `stage` (loaded, ready); a worker that reports an error or dies stops the start
        with its reason."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, worker) in enumerate(zip(self.conns, self.workers, strict=True), start=1):
            ready = multiprocessing.connection.wait([conn, worker.sentinel], timeout=deadline - time.monotonic())
            reason = None if ready else f"no word in {START_TIMEOUT_S:.0f} s"
            if conn in ready:
                try:
                    got, detail = conn.recv()
                    if got == stage:
                        continue
                    reason = detail
                except EOFError:  # it exited without a word
                    pass
            if reason is None:  # it exited: its exit code is known once it is reaped
                worker.join(timeout=5)
                reason = f"the process exited (code {worker.exitcode})"
            self.close()
            raise ConfigError(f"tensor-parallel rank {rank} failed to start: {reason}")

    def unlink_segment(self) -> None:
        """Every rank has the shared segment mapped (they join before they load): its name can go, so that nothing
        is left in /dev/shm however the processes end."""
        if self.spec.shm_path and os.path.exists(self.spec.shm_path):
            os.unlink(self.spec.shm_path)

    def started(self) -> None:
        """The group is up: a thread watches the workers from now on."""
        threading.Thread(target=self._watch, name="tokenmill-tp-monitor", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {worker.sentinel: rank for rank, worker in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closed:
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        self.failure = f"tensor-parallel rank {rank} exited (code {self.workers[rank - 1].exitcode})"
        log.error("%s: the engine stops", self.failure)
        self.group.abort(rank)

    def check(self, exc: BaseException | None = None) -> None:
        """Raise RankFailure where the group failed; exc: what a step raised, which fails it (the ranks may be out
        of step: a rank gone or hung, or a step that stopped between two of its collectives)."""
        if exc is not None and self.failure is None:
            self.failure = f"a tensor-parallel step failed: {exc}"
        if self.failure is not None:
            raise RankFailure(self.failure) from exc

    def close(self) -> None:
        """Stop the workers (told to, then made to) and leave the group."""
        if self._closed:
            return
        self._closed = True
        graceful = self.failure is None and all(w.is_alive() for w in self.workers)
        if graceful:
            try:
                self.group.send(("stop",))
            except Exception:  # a rank gone meanwhile: the processes are ended below
                log.debug("tensor-parallel stop not delivered", exc_info=True)
                graceful = False
        self._stop_workers(graceful)
        self.group.close()

    def _stop_workers(self, graceful: bool = True) -> None:
        """Wait for the workers to leave (graceful: they were told to), else end them (a hung one, SIGKILL)."""
        for worker in self.workers:
            worker.join(timeout=5 if graceful else 0)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        self.unlink_segment()


def start_rank0(config: EngineConfig) -> tuple[TensorParallel, LoadedModel]:
    """Spawn the workers, load rank 0's shard beside them, and agree on the KV pool (built by the caller from
    config with agree=agree_min, as every worker builds its own). A model the ranks cannot split is refused before
    any rank starts."""
    check_shardable(read_config(config.model), config.tensor_parallel_size)
    tp = TensorParallel(config)
    try:
        torch.set_num_threads(rank_threads(config))
        loaded = load_shard(config, 0)
        all_reduce_partial_sums(loaded.model, tp.group)  # type: ignore[arg-type]
        tp.wait_for("loaded")
        tp.unlink_segment()
    except BaseException:
        tp.close()
        raise
    loaded.model = ShardedModel(loaded.model, tp.group, loaded.config.vocab_size)  # type: ignore[arg-type]
    return tp, loaded


def run_node(config: EngineConfig) -> int:
    """Host --node-rank K (K > 0): its ranks, until rank 0 stops them or is gone; 1 if one of them failed."""
    size, per_host = config.tensor_parallel_size, local_ranks(config)
    spec = group_spec(config, shm=False)
    first = config.node_rank * per_host
    conns, workers = spawn_ranks(config, spec, range(first, first + per_host))
    log.info("host %d of %d: tensor-parallel ranks %d-%d of %d, meeting at %s", config.node_rank, config.nnodes,
             first, first + per_host - 1, size, spec.init_method)
    failed = False
    for rank, (conn, worker) in enumerate(zip(conns, workers, strict=True), start=first):
        while True:  # the rank's reports, until it exits (its end of the pipe closes)
            try:
                stage, detail = conn.recv()
            except EOFError:
                break
            if stage == "error":
                log.error("tensor-parallel rank %d failed to start: %s", rank, detail)
                failed = True
        worker.join()
        failed |= worker.exitcode != 0
    return 1 if failed else 0


# --- a worker's process ---------------------------------------------------------------------------------------

def run_worker(config: EngineConfig, spec: GroupSpec, rank: int, conn: Connection, log_level: int,
               environ: dict[str, str]) -> None:
    """A worker rank: join the group, load its shard, build its KV pool, then run what rank 0 sends until told to
    stop, or until the process that started it is gone: that one never writes to `conn`, so a read that would not
    block is its end closing. environ: the starter's environment at the rank's start (the fork server's dates
    from its own start)."""
    os.environ.clear()
    os.environ.update(environ)
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    try:
        torch.set_num_threads(rank_threads(config))
        kernels.use_decode_fetch_ahead(config.decode_fetch_ahead)
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's, and every kernel's, default device
        group = join(spec, rank, device, shares_gpus(config))
        loaded = load_shard(config, rank)
        model = loaded.model
        assert isinstance(model, LlamaForCausalLM)
        all_reduce_partial_sums(model, group)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("loaded", None))
    try:
        cache = build_kv_cache(config, kv_spec(loaded, config.kv_cache_dtype), device, loaded.max_model_len,
                               agree=agree_min)
        assert isinstance(cache, PagedKVCache)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    widths = Shard(rank, spec.size).widths(loaded.config.vocab_size)
    try:
        serve(group, model, cache, widths, device, lambda: not conn.poll())
    except Exception as exc:  # rank 0 gone (its host's process, or the connection to another host)
        log.error("rank %d leaves the group: %s", rank, exc)
        raise SystemExit(1) from exc
    finally:
        group.close()


def serve(group: Group, model: LlamaForCausalLM, cache: PagedKVCache, widths: list[int], device: torch.device,
          alive: Callable[[], bool]) -> None:
    """Run rank 0's commands: a step's forward pass, the head over rows of its hidden states, stop."""
    with torch.inference_mode():
        while True:
            command, *args = group.receive(alive)
            if command == "forward":
                ids, positions, meta = args
                model(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device),
                      _meta_from_wire(meta, cache, device))
            elif command == "logits":
                group.gather_columns(model.compute_logits(_tensor_from_wire(args[0], device)), widths)
            elif command == "stop":
                return


# --- a step's inputs as plain arrays (pickled cheaply; the pools stay on each rank) ----------------------------

def _map_arrays(obj: Any, convert: Callable[[Any], Any], kind: type) -> Any:
    """obj with every `kind` (tensor or array) in it converted, through lists, tuples and dataclasses."""
    if isinstance(obj, kind):
        return convert(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map_arrays(o, convert, kind) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_arrays(getattr(obj, f.name), convert, kind)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _without_pools(meta: PagedMetadata) -> PagedMetadata:
    sliding = None if meta.sliding is None else _without_pools(meta.sliding)
    return dataclasses.replace(meta, k_layers=(), v_layers=(), sliding=sliding)


def _meta_to_wire(meta: PagedMetadata) -> PagedMetadata:
    return _map_arrays(_without_pools(meta), lambda t: t.cpu().numpy(), torch.Tensor)


def _meta_from_wire(meta: PagedMetadata, cache: PagedKVCache, device: torch.device) -> PagedMetadata:
    meta = _map_arrays(meta, lambda a: torch.from_numpy(a).to(device), np.ndarray)
    meta.k_layers, meta.v_layers = cache.full.k_layers, cache.full.v_layers
    if meta.sliding is not None:
        assert cache.sliding is not None
        meta.sliding.k_layers, meta.sliding.v_layers = cache.sliding.k_layers, cache.sliding.v_layers
    return meta


def _tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """numpy has no bf16: 16-bit values travel as int16 and are viewed back."""
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy(), dtype


def _tensor_from_wire(wire: tuple[np.ndarray, str], device: torch.device) -> torch.Tensor:
    array, dtype = wire
    return torch.from_numpy(array).view(getattr(torch, dtype)).to(device)
