"""The models a server hosts, each an engine of its own, under one memory budget: a model loads when a request first
names it, and the least recently used idle one unloads when a load would pass the budget, or when it has been idle
for its keep_alive. A model with a request in flight (a lease, or an unfinished sequence) never unloads.

Everything here runs on the server's event loop, but for the engines' start and stop, which run in worker
threads; one load runs at a time, so each model's memory is measured alone."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.cache.sizing import available_memory
from tokenmill.config import EngineConfig, parse_size
from tokenmill.engine.engine import Engine
from tokenmill.errors import (
    ConfigError,
    EngineError,
    EngineUnavailableError,
    ModelFormatError,
    ModelNotFoundError,
    ModelUnavailableError,
    NotFoundError,
    RequestError,
)
from tokenmill.hosting.specs import ModelSpec
from tokenmill.loader import release_freed_memory
from tokenmill.loader.sources import local_path

log = logging.getLogger(__name__)

UNSET = object()  # a request that gives no keep_alive: the model's own applies
_REAP_INTERVAL_S = 0.25


def resident_bytes() -> int:
    """This process's resident memory (RSS), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def machine_memory() -> int:
    """What the machine has for the models: nine tenths of the memory available now (the rest: the process's own
    and each load's transient peak, which footprints do not count)."""
    return available_memory() * 9 // 10


def estimate_bytes(config: EngineConfig) -> int:
    """Memory a model should take before it has loaded once (after, its measured footprint is used): its weights'
    files (twice a checkpoint's size in fp32, which widens 16-bit values) and its KV memory."""
    path = local_path(config.model)
    if path.is_file():
        weights = path.stat().st_size
    elif path.is_dir():
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        weights *= 2 if config.dtype in ("float32", "fp32") else 1
    else:
        weights = 0
    kv = parse_size(config.kv_cache_memory) if config.kv_cache_memory else machine_memory() // 10
    return weights + kv


@dataclass
class HostedModel:
    """One model of the pool and its engine while loaded. state: unloaded, loading, loaded or unloading."""

    spec: ModelSpec
    engine: Engine | None = None
    state: str = "unloaded"
    leases: int = 0  # requests that named it and have not yet handed their sequences to the engine
    last_used: float = 0.0  # monotonic: when it was last seen busy
    keep_alive: float | None = None  # seconds it stays loaded once idle (None: until memory is needed)
    footprint: int = 0  # what its weights and KV memory took when it last loaded
    resident_growth: int | None = None  # how much the process's resident memory grew while it last loaded
    load_s: float | None = None
    unload_s: float | None = None
    loads: int = 0
    task: asyncio.Future[None] | None = field(default=None, repr=False)  # its load or unload under way
    # its LoRA adapters (--lora's, then those loaded at run time), name -> path: loaded into each engine it gets
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.adapters.update(self.spec.engine.lora_adapters())

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.engine is not None and self.engine.num_unfinished > 0)

    def describe(self) -> dict[str, object]:
        """What /v1/models and the dashboard say of it."""
        idle = None if self.state != "loaded" or self.busy else round(time.monotonic() - self.last_used, 1)
        return {"state": self.state, "loaded": self.state == "loaded", "memory_bytes": self.footprint or None,
                "resident_growth_bytes": self.resident_growth,
                "load_seconds": self.load_s, "unload_seconds": self.unload_s, "loads": self.loads,
                "idle_seconds": idle, "keep_alive": self.keep_alive if self.keep_alive is not None else -1}


class ModelPool:
    """max_memory: bytes the loaded models may take together (their footprints); load_timeout: seconds a request
    waits for its model to load (or for memory to free) before a 503 with Retry-After."""

    def __init__(self, specs: list[ModelSpec], max_memory: int | None = None, load_timeout: float = 300.0) -> None:
        self.models = [HostedModel(spec, keep_alive=spec.keep_alive) for spec in specs]
        self._by_name = {name: hosted for hosted in self.models for name in (*hosted.spec.names, *hosted.adapters)}
        if len(self._by_name) < sum(len(h.spec.names) + len(h.adapters) for h in self.models):
            raise ConfigError("a LoRA adapter has the name of a model, an alias or another adapter")
        self.max_memory = max_memory if max_memory is not None else machine_memory()
        self.load_timeout = load_timeout
        self.closed = False
        self._loading: asyncio.Lock | None = None  # made on the loop
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    def of_engine(cls, engine: Engine, name: str, aliases: set[str] | frozenset[str] = frozenset()) -> ModelPool:
        """A pool of one model whose engine the caller made (started, or started by start())."""
        pool = cls([ModelSpec(name, engine.config, frozenset(aliases) - {name})])
        hosted = pool.models[0]
        hosted.engine, hosted.state, hosted.last_used = engine, "loaded", time.monotonic()
        return pool

    # --- names ------------------------------------------------------------------------------------------

    def find(self, name: str) -> HostedModel:
        hosted = self._by_name.get(name)
        if hosted is None:
            raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return hosted

    def adapter_of(self, name: str) -> str | None:
        """The LoRA adapter a model name is (None: a model or an alias)."""
        hosted = self._by_name.get(name)
        return name if hosted is not None and name in hosted.adapters else None

    async def load_adapter(self, name: str, path: str, base: str | None) -> HostedModel:
        """Load a LoRA adapter at run time beside `base` (None: the first model that serves adapters), loading the
        base first where it is not; its name is then a model of /v1/models until unloaded."""
        if name in self._by_name:
            raise RequestError(f"the name {name} is taken: a model, an alias or a loaded LoRA adapter",
                               param="lora_name")
        hosted = self.find(base) if base is not None else next(
            (h for h in self.models if h.spec.engine.lora_enabled), None)
        if hosted is None or not hosted.spec.engine.lora_enabled:
            raise RequestError("no model here serves LoRA adapters (--enable-lora)", param="lora_name")
        async with self.lease(hosted.name) as leased:
            assert leased.engine is not None
            await asyncio.to_thread(leased.engine.load_lora, name, path)
        hosted.adapters[name] = path
        self._by_name[name] = hosted
        return hosted

    async def unload_adapter(self, name: str) -> None:
        hosted = self._by_name.get(name)
        if hosted is None or name not in hosted.adapters:
            raise NotFoundError(f"The LoRA adapter `{name}` is not loaded.", param="lora_name")
        if hosted.engine is not None and hosted.state == "loaded":
            await asyncio.to_thread(hosted.engine.unload_lora, name)
        del hosted.adapters[name], self._by_name[name]

    @property
    def first(self) -> HostedModel:
        return self.models[0]

    def loaded(self) -> list[HostedModel]:
        return [h for h in self.models if h.state == "loaded" and h.engine is not None]

    # --- the server's life ------------------------------------------------------------------------------

    def preload(self) -> None:
        """Before serving (in the caller's thread): load the models in their order while they fit the budget, so
        that a single model serves at once and a broken first model fails the start."""
        for hosted in self.models:
            if hosted.state == "loaded":
                continue
            if self.used_bytes() + self.expected_bytes(hosted) > self.max_memory and self.loaded():
                log.info("%s loads when first asked for (the memory budget holds %s)", hosted.name,
                         ", ".join(h.name for h in self.loaded()))
                continue
            self._start_engine(hosted)

    async def start(self) -> None:
        """On the server's loop: start engines made but not started, then watch keep_alive."""
        self._loading = asyncio.Lock()
        for hosted in self.loaded():
            assert hosted.engine is not None
            if not hosted.engine.alive:
                await asyncio.to_thread(hosted.engine.start)
            hosted.footprint = hosted.footprint or hosted.engine.memory_bytes()
        self._reaper = asyncio.ensure_future(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for hosted in self.models:
            if hosted.engine is not None:
                await asyncio.to_thread(hosted.engine.stop)

    def close(self) -> None:
        """Take no more requests (a graceful shutdown's end)."""
        self.closed = True
        for hosted in self.loaded():
            assert hosted.engine is not None
            hosted.engine.close()

    def abort_all(self) -> None:
        for hosted in self.loaded():
            assert hosted.engine is not None
            hosted.engine.abort_all()

    @property
    def num_unfinished(self) -> int:
        return sum(h.engine.num_unfinished for h in self.loaded() if h.engine is not None)

    def dead(self) -> list[str]:
        """Models whose engine died while loaded (an unload stops an engine on purpose, and is not this)."""
        return [h.name for h in self.loaded() if h.engine is not None and not h.engine.alive]

    # --- requests ---------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, name: str, keep_alive: object = UNSET) -> AsyncIterator[HostedModel]:
        """The model a request names, loaded, and kept from unloading until the request has handed its sequences
        to the engine (from then on, they keep it); keep_alive: the request's (Ollama's field), else the
        model's."""
        hosted = self.find(name)
        if self.closed:
            raise EngineUnavailableError("the server is shutting down")
        hosted.leases += 1
        try:
            await self._wait_loaded(hosted)
            hosted.keep_alive = hosted.spec.keep_alive if keep_alive is UNSET else keep_alive  # type: ignore[assignment]
            yield hosted
        finally:
            hosted.leases -= 1
            hosted.last_used = time.monotonic()

    async def _wait_loaded(self, hosted: HostedModel) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout
        while hosted.state != "loaded":
            if hosted.task is None:
                hosted.task = asyncio.ensure_future(self._load(hosted))
            remaining = deadline - loop.time()
            try:
                await asyncio.wait_for(asyncio.shield(hosted.task), max(remaining, 0.0))
            except TimeoutError:
                raise ModelUnavailableError(
                    f"The model `{hosted.name}` is still loading or waiting for memory after {self.load_timeout:g} "
                    "s. Retry later.", retry_after=5) from None
            except (ModelFormatError, ConfigError) as exc:
                raise EngineError(f"the model `{hosted.name}` could not be loaded: {exc}") from exc

    # --- loading and unloading --------------------------------------------------------------------------

    def used_bytes(self, but: HostedModel | None = None) -> int:
        return sum(self.expected_bytes(h) for h in self.models
                   if h is not but and h.state in ("loaded", "loading", "unloading"))

    def expected_bytes(self, hosted: HostedModel) -> int:
        return hosted.footprint or estimate_bytes(hosted.spec.engine)

    async def _load(self, hosted: HostedModel) -> None:
        assert self._loading is not None, "start() first"
        try:
            async with self._loading:
                if hosted.state == "loaded":
                    return
                await self._make_room(hosted)
                hosted.state = "loading"
                try:
                    await asyncio.to_thread(self._start_engine, hosted)
                finally:
                    if hosted.state == "loading":
                        hosted.state = "unloaded"
                await self._trim_to_budget(hosted)
        finally:
            hosted.task = None

    def _start_engine(self, hosted: HostedModel) -> None:
        """Load and start the model's engine (any thread) and record what it took."""
        log.info("loading %s (%s)", hosted.name, hosted.spec.engine.model)
        before, started = resident_bytes(), time.perf_counter()
        # The engine loads the adapters after it starts: --lora's and those loaded at run time alike.
        engine = Engine(dataclasses.replace(hosted.spec.engine, lora=(), enable_lora=hosted.spec.engine.lora_enabled))
        try:
            engine.start()
            static = dict(hosted.spec.engine.lora_adapters())
            for name, path in list(hosted.adapters.items()):
                try:
                    engine.load_lora(name, path)
                except (ModelFormatError, RequestError) as exc:
                    if name in static:  # --lora's: the model does not load without it
                        raise
                    log.warning("%s: the LoRA adapter %s loaded at run time is dropped: %s", hosted.name, name, exc)
                    del hosted.adapters[name], self._by_name[name]
        except BaseException:
            if engine.alive:
                engine.stop()
            del engine
            _collect()
            raise
        hosted.load_s = round(time.perf_counter() - started, 2)
        hosted.footprint = engine.memory_bytes()
        hosted.resident_growth = resident_bytes() - before
        hosted.engine, hosted.state, hosted.loads = engine, "loaded", hosted.loads + 1
        hosted.last_used = time.monotonic()
        log.info("loaded %s in %.1f s: weights and KV %.0f MiB, resident %.0f -> %.0f MiB (the models hold %.0f of "
                 "%.0f MiB)", hosted.name, hosted.load_s, hosted.footprint / 2**20, before / 2**20,
                 resident_bytes() / 2**20, self.used_bytes() / 2**20, self.max_memory / 2**20)

    async def _make_room(self, hosted: HostedModel) -> None:
        """Unload the least recently used idle models until `hosted` fits the budget; wait for busy ones to go
        idle until the load timeout."""
        need = self.expected_bytes(hosted)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout
        while self.used_bytes(but=hosted) + need > self.max_memory:
            others = [h for h in self.loaded() if h is not hosted]
            if not others and not any(h.state in ("loading", "unloading") for h in self.models if h is not hosted):
                raise EngineError(f"the model `{hosted.name}` needs about {need / 2**20:.0f} MiB, more than the "
                                  f"memory budget of {self.max_memory / 2**20:.0f} MiB (--max-memory)")
            idle = self._idle_but(hosted)
            if idle:
                await asyncio.shield(self._begin_unload(idle[0], f"to make room for {hosted.name}"))
                continue
            if loop.time() >= deadline:
                raise ModelUnavailableError(
                    f"The model `{hosted.name}` needs memory that models with requests in flight hold "
                    f"({', '.join(h.name for h in others)}). Retry later.", retry_after=5)
            await asyncio.sleep(0.1)

    async def _trim_to_budget(self, hosted: HostedModel) -> None:
        """After a load that took more than expected: unload idle others until the budget holds again."""
        while self.used_bytes() > self.max_memory:
            idle = self._idle_but(hosted)
            if not idle:
                log.warning("the loaded models hold %.0f MiB, past the budget of %.0f MiB, and none is idle",
                            self.used_bytes() / 2**20, self.max_memory / 2**20)
                return
            await asyncio.shield(self._begin_unload(idle[0], "the last load took more memory than expected"))

    def _idle_but(self, hosted: HostedModel) -> list[HostedModel]:
        """The loaded models other than `hosted` that may unload now, least recently used first."""
        return sorted((h for h in self.loaded() if h is not hosted and not h.busy and h.task is None),
                      key=lambda h: h.last_used)

    def _begin_unload(self, hosted: HostedModel, why: str) -> asyncio.Future[None]:
        """Unload an idle model: from now on it is not loaded (a request for it waits for this, then loads it)."""
        engine = hosted.engine
        assert engine is not None and hosted.task is None
        hosted.engine, hosted.state = None, "unloading"
        hosted.task = asyncio.ensure_future(self._stop_engine(hosted, engine, why))
        return hosted.task

    async def _stop_engine(self, hosted: HostedModel, engine: Engine, why: str) -> None:
        try:
            before, started = resident_bytes(), time.perf_counter()
            await asyncio.to_thread(engine.stop)
            del engine
            await asyncio.to_thread(_collect, refreeze=any(h.spec.engine.freeze_gc for h in self.loaded()))
            hosted.unload_s = round(time.perf_counter() - started, 2)
            log.info("unloaded %s (%s) in %.1f s: resident %.0f -> %.0f MiB", hosted.name, why, hosted.unload_s,
                     before / 2**20, resident_bytes() / 2**20)
        finally:
            hosted.state, hosted.task = "unloaded", None

    async def _reap(self) -> None:
        """Unload models idle for longer than their keep_alive; note when each was last seen busy."""
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            now = time.monotonic()
            for hosted in self.loaded():
                if hosted.busy:
                    hosted.last_used = now
                elif hosted.task is None and hosted.keep_alive is not None and \
                        now - hosted.last_used >= hosted.keep_alive:
                    self._begin_unload(hosted, f"idle for {now - hosted.last_used:.0f} s")


def _collect(refreeze: bool = False) -> None:
    """Give an unloaded engine's memory back to the system: its cycles collected, the heap's free pages trimmed.
    refreeze: set the heap aside from the collector again for the engines still loaded (stopping one thawed it)."""
    gc.collect()
    release_freed_memory()
    if refreeze:
        gc.freeze()
