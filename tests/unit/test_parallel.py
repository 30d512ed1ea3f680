"""Tensor parallelism's parts: which share of each tensor a rank takes (parallel/sharding.py), and the
shared-memory collectives between ranks (parallel/collectives.py, kernels/collectives.cpp)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os

import numpy as np
import pytest
import torch

from tokenmill import backend
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.models.config import ModelConfig
from tokenmill.parallel import collectives
from tokenmill.parallel.collectives import ShmGroup, new_spec
from tokenmill.parallel.sharding import Shard, check_shardable, shard_config, shard_weights

CONFIG = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=64, tie_word_embeddings=True)


def test_spans_cover_everything_once_and_as_evenly_as_can_be() -> None:
    assert [Shard(r, 3).span(10) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert Shard(0, 3).widths(10) == [3, 3, 4]
    assert sum(Shard(0, 4).widths(49152)) == 49152


def test_a_ranks_config_holds_its_heads_rows_and_head() -> None:
    ranked = shard_config(CONFIG, Shard(1, 2))
    assert (ranked.num_heads, ranked.num_kv_heads, ranked.intermediate_size) == (2, 1, 6)
    assert all(type(n) is int for n in (ranked.num_heads, ranked.num_kv_heads, ranked.intermediate_size))
    assert ranked.head_rows == 5 and ranked.tie_word_embeddings is False  # its own rows of the embeddings
    assert shard_config(dataclasses.replace(CONFIG, num_kv_heads=1), Shard(1, 2)).num_kv_heads == 1  # replicated


def named(config: ModelConfig) -> dict[str, torch.Tensor]:
    h, q, kv, mlp = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (q, h), "model.layers.0.self_attn.q_proj.bias": (q,),
              "model.layers.0.self_attn.k_proj.weight": (kv, h), "model.layers.0.self_attn.v_proj.weight": (kv, h),
              "model.layers.0.self_attn.o_proj.weight": (h, q), "model.layers.0.mlp.gate_proj.weight": (mlp, h),
              "model.layers.0.mlp.up_proj.weight": (mlp, h), "model.layers.0.mlp.down_proj.weight": (h, mlp)}
    return {name: torch.arange(np.prod(shape), dtype=torch.float32).view(shape) for name, shape in shapes.items()}


@pytest.mark.parametrize(("kv_heads", "size"), [(2, 2), (1, 2), (2, 4)])
def test_each_rank_takes_its_heads_rows_and_columns(kv_heads: int, size: int) -> None:
    config = dataclasses.replace(CONFIG, num_kv_heads=kv_heads, intermediate_size=24)
    full = named(config)
    for rank in range(size):
        got = dict(shard_weights(full.items(), config, Shard(rank, size)))
        heads = 4 // size
        q = slice(2 * heads * rank, 2 * heads * (rank + 1))  # its query heads, of two values each
        if kv_heads >= size:
            kv = slice(2 * rank, 2 * rank + 2)
        else:  # fewer KV heads than ranks: each rank holds the one its query heads read
            head = rank * kv_heads // size
            kv = slice(2 * head, 2 * head + 2)
        mlp = slice(24 // size * rank, 24 // size * (rank + 1))
        vocab = Shard(rank, size).span(10)
        layer = "model.layers.0."
        assert torch.equal(got[layer + "mlp.gate_proj.weight"], full[layer + "mlp.gate_proj.weight"][mlp])
        assert torch.equal(got[layer + "self_attn.q_proj.weight"], full[layer + "self_attn.q_proj.weight"][q])
        assert torch.equal(got[layer + "self_attn.q_proj.bias"], full[layer + "self_attn.q_proj.bias"][q])
        assert torch.equal(got[layer + "self_attn.k_proj.weight"], full[layer + "self_attn.k_proj.weight"][kv])
        assert torch.equal(got[layer + "self_attn.v_proj.weight"], full[layer + "self_attn.v_proj.weight"][kv])
        assert torch.equal(got[layer + "self_attn.o_proj.weight"], full[layer + "self_attn.o_proj.weight"][:, q])
        assert torch.equal(got[layer + "mlp.up_proj.weight"], full[layer + "mlp.up_proj.weight"][mlp])
        assert torch.equal(got[layer + "mlp.down_proj.weight"], full[layer + "mlp.down_proj.weight"][:, mlp])
        assert torch.equal(got["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # whole
        assert torch.equal(got["model.norm.weight"], full["model.norm.weight"])
        assert torch.equal(got["lm_head.weight"], full["model.embed_tokens.weight"][vocab[0]:vocab[1]])


def test_a_quantized_matrix_is_cut_on_block_boundaries_or_refused_by_name() -> None:
    rng = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (48, 256 // 2), dtype=torch.uint8, generator=rng)  # 48 rows of 256 4-bit weights
    weight = QuantizedWeight.interleave(q, torch.rand(48, 8, generator=rng), torch.rand(48, 8, generator=rng), 0, 32)
    dense = weight.dequantize()
    assert torch.equal(weight.columns(64, 192).dequantize(), dense[:, 64:192])
    config = dataclasses.replace(CONFIG, num_heads=4, num_kv_heads=4, head_dim=64, hidden_size=256,
                                 intermediate_size=48)
    o_proj, gate = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    got = dict(shard_weights([(o_proj, weight), (gate, weight)], config, Shard(1, 2)))
    assert torch.equal(got[o_proj].dequantize(), dense[:, 128:256])  # columns: whole blocks of 32
    assert torch.equal(got[gate].dequantize(), dense[24:48])  # rows
    config = dataclasses.replace(config, head_dim=40, num_heads=6, num_kv_heads=6)
    with pytest.raises(ModelFormatError, match="o_proj.weight: a rank.s columns 80..160 would cut a quantized block"):
        dict(shard_weights([(o_proj, weight)], config, Shard(1, 3)))


def test_a_bias_after_a_split_matmul_is_refused() -> None:
    with pytest.raises(ConfigError, match="o_proj.bias: a bias after a split matmul"):
        dict(shard_weights([("model.layers.0.self_attn.o_proj.bias", torch.zeros(8))], CONFIG, Shard(0, 2)))


@pytest.mark.parametrize(("change", "size", "why"), [
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}, 2, "mixture-of-experts"),
    ({"qk_norm": True, "qk_norm_per_head": False}, 2, "q/k norms span the whole projection"),
    ({}, 3, "4 query heads do not divide among 3 ranks"),
    ({"num_heads": 6, "num_kv_heads": 4}, 3, "4 KV heads neither divide"),
    ({"intermediate_size": 13}, 2, "MLP's 13 rows"),
])
def test_models_the_ranks_cannot_split_are_refused_with_the_reason(change: dict, size: int, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_shardable(dataclasses.replace(CONFIG, **change), size)
    # and these split: the model as it is, per-head q/k norms (Qwen3), one KV head on two ranks
    for fine in ({}, {"qk_norm": True}, {"num_kv_heads": 1}):
        check_shardable(dataclasses.replace(CONFIG, **fine), 2)


def _rank(path: str, rank: int, size: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(path, rank, size)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        # larger than a slot: it goes in pieces
        x = torch.arange(collectives.SLOT_BYTES // 4 + 1000, dtype=torch.float32).mul(rank + 1).div(7).to(dtype)
        out[str(dtype)] = group.all_reduce(x)[-5:].float().tolist()
    width = [3, 4, 5][rank]
    part = torch.full((2, width), float(rank))
    gathered = group.gather_columns(part, [3, 4, 5][:size])
    out["gather"] = None if gathered is None else gathered.tolist()
    big = "x" * (collectives.SLOT_BYTES + 10)  # an object of more than one slot
    out["sent"] = group.send(("hello", big)) if rank == 0 else group.receive(lambda: True) == ("hello", big)
    results.put((rank, out))


@pytest.mark.skipif(not backend.cpu_kernels(torch.device("cpu")), reason="the C++ kernels are unavailable here")
def test_shared_memory_collectives_sum_gather_and_send_across_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "SLOT_BYTES", 1 << 16)  # spawned ranks read the module's own: patched below
    size = 3
    spec = new_spec(size, shm=True)
    assert spec.shm_path is not None
    assert os.stat(spec.shm_path).st_mode & 0o777 == 0o600  # no other user reads the requests' activations
    ctx = multiprocessing.get_context("fork")  # the patched slot size reaches the ranks
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(spec.shm_path, r, size, results)) for r in range(size)]
    for p in ranks:
        p.start()
    got = dict(results.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(timeout=10)
    os.unlink(spec.shm_path)
    n = (1 << 16) // 4 + 1000
    expected = [float(torch.tensor(i / 7 * 1 + i * 2 / 7 + i * 3 / 7)) for i in range(n - 5, n)]
    for rank in range(size):
        assert got[rank]["torch.float32"] == pytest.approx(expected, rel=1e-6)
        assert got[rank]["torch.float32"] == got[0]["torch.float32"]  # the same bits on every rank
        assert got[rank]["torch.bfloat16"] == got[0]["torch.bfloat16"]
    assert got[0]["gather"] == [[0.0] * 3 + [1.0] * 4 + [2.0] * 5] * 2
    assert got[1]["gather"] is None and got[1]["sent"] and got[2]["sent"]


def _fails_to_load(conn) -> None:
    conn.send(("error", "ModelFormatError: rank 1's shard is broken"))


def _dies(conn) -> None:
    os._exit(3)


@pytest.mark.parametrize(("target", "reason"), [
    (_fails_to_load, "rank 1 failed to start: ModelFormatError: rank 1's shard is broken"),
    (_dies, r"rank 1 failed to start: the process exited \(code 3\)"),
])
def test_a_rank_that_fails_to_start_stops_the_start_with_its_reason(target, reason: str) -> None:
    from tokenmill.engine.tensor_parallel import TensorParallel

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=target, args=(theirs,))
    worker.start()
    theirs.close()
    tp = object.__new__(TensorParallel)  # the start's bookkeeping only: no group to leave
    tp.conns, tp.workers, tp._closed = [ours], [worker], True
    with pytest.raises(ConfigError, match=reason):
        tp.wait_for("loaded")
    worker.join()
