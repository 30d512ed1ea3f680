"""The paged KV cache's pool of its own for sliding-window layers, and how KV memory is split between the pools."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import KVSpec, PagedKVCache
from tokenmill.cache.sizing import build_kv_cache
from tokenmill.config import EngineConfig
from tokenmill.hosting.pool import resident_bytes
from tokenmill.layers.attention import SequenceSlice

CPU = torch.device("cpu")
BLOCK = 4
# Three layers, the middle one global; the others see their last 6 keys, which straddle at most 3 blocks of 4.
SPEC = KVSpec(num_layers=3, num_kv_heads=1, head_dim=2, dtype=torch.float32, sliding_layers=(True, False, True),
              window=6)


def test_the_sliding_pool_lets_go_of_the_blocks_its_window_has_passed() -> None:
    cache = PagedKVCache(SPEC, CPU, num_blocks=16, block_size=BLOCK, sliding_blocks=3)
    assert cache.sliding is not None and cache.k.shape[0] == 1 and cache.sliding.k.shape[0] == 2
    assert cache.reserve(0, 5, 40)  # a prompt of 5: two blocks in each pool
    for computed in range(5, 40):  # a token a step: the three sliding blocks suffice
        assert cache.reserve(0, computed + 1, 40, computed)
        table = cache.sliding.tables[0]
        first = (computed - 6 + 1) // BLOCK if computed >= 6 else 0  # the first block the window sees
        assert table[:first] == [0] * first and all(table[first:]) and len(cache.sliding.live) <= 3
        meta = metadata.prepare(cache, [SequenceSlice(0, computed, 1)])
        assert meta.of_layer(1) == (meta, 0) and meta.of_layer(2) == (meta.sliding, 1)
        assert meta.sliding is not None
        block, offset = divmod(computed, BLOCK)
        assert meta.sliding.slot_mapping.tolist() == [table[block] * BLOCK + offset]
        assert meta.slot_mapping.tolist() == [cache.tables[0][block] * BLOCK + offset]
        assert meta.sliding.decode_tables.tolist() == table and meta.decode_tables.tolist() == cache.tables[0]
    assert cache.blocks_of(0) == 10 and cache.usage() == 2 / 3  # of the fuller pool: 2 of 3 sliding blocks
    cache.free(0)
    assert cache.pool.num_free == 16 and cache.sliding.blocks.num_free == 3 and cache.usage() == 0


def test_a_short_sliding_pool_evicts_cached_sliding_blocks_first() -> None:
    cache = PagedKVCache(SPEC, CPU, num_blocks=16, block_size=BLOCK, prefix_caching=True, sliding_blocks=4)
    tokens = list(range(100, 112))
    assert cache.reserve(0, 12, 12)
    cache.cache(0, tokens)
    cache.free(0)  # the tree holds its 3 blocks in each pool
    assert cache.sliding is not None and cache.sliding.blocks.num_free == 1
    assert cache.reserve(1, 8, 8)  # 2 sliding blocks: one of the cached ones goes
    assert cache.sliding.blocks.num_free == 0 and cache.pool.num_free == 16 - 3 - 2
    assert not cache.reserve(2, 12, 12)  # 3 more: the pool is short even after evicting, and nothing is taken
    assert 2 not in cache.tables and cache.pool.num_free == 16 - 3 - 2


def sizes(cache: PagedKVCache) -> tuple[int, int]:
    return cache.pool.num_blocks, 0 if cache.sliding is None else cache.sliding.blocks.num_blocks


@pytest.mark.parametrize("sliding_window_kv", [True, False])
def test_kv_memory_gives_the_sliding_pool_max_num_seqs_windows_and_the_rest_to_the_global_layers(
        sliding_window_kv: bool) -> None:
    # Gemma 3 270M's pattern: 18 layers, every sixth global; 1 KiB a token a layer.
    spec = KVSpec(18, 1, 256, torch.float16, tuple(i % 6 != 5 for i in range(18)), window=512)
    config = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="64MiB",
                          sliding_window_kv=sliding_window_kv)
    cache = build_kv_cache(config, spec, CPU, max_model_len=1 << 18)
    assert isinstance(cache, PagedKVCache)
    if not sliding_window_kv:  # every layer in one pool
        assert sizes(cache) == ((64 << 20) // (16 * 18 * 1024), 0)
        return
    # Each sequence's window straddles 511 // 16 + 2 blocks; one step's prompt tokens take 4 more.
    sliding = 4 * 33 + 4
    assert sizes(cache) == (((64 << 20) - sliding * 16 * 15 * 1024) // (16 * 3 * 1024), sliding)
    assert cache.sliding is not None
    held = sum(t.numel() for t in (cache.k, cache.v, cache.sliding.k, cache.sliding.v)) * 2
    block = 16 * 18 * 1024  # a block of every layer
    assert (64 << 20) - 4 * block < held <= (64 << 20) + 4 * block  # the budget, give or take each pool's 2 extra
    # Capped by what max_num_seqs contexts need; too small a budget for the windows: the same blocks in each pool.
    assert sizes(build_kv_cache(config, spec, CPU, max_model_len=640)) == (160, 136)
    assert sizes(build_kv_cache(config, spec, CPU, max_model_len=400)) == (100, 100)
    for memory, blocks in (("1MiB", 3), ("36MiB", 128)):  # 36 MiB: the windows' 136 blocks (32 MiB) fit, alone
        small = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=memory)
        assert sizes(build_kv_cache(small, spec, CPU, max_model_len=1 << 18)) == (blocks, blocks)
    # Without chunked prefill a whole prompt runs in one step, one longer than the step's budget alone: the
    # sliding pool holds the others' windows and a whole context (before, a prompt past its room never ran).
    whole = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="128MiB",
                         chunked_prefill=False)
    assert sizes(build_kv_cache(whole, spec, CPU, max_model_len=2048))[1] == 4 * 33 + 2048 // 16
    chunked = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="128MiB")
    assert sizes(build_kv_cache(chunked, spec, CPU, max_model_len=2048))[1] == 4 * 33 + 4  # the step's 64 tokens


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_a_cpu_pool_costs_no_memory_until_its_blocks_are_written() -> None:
    """A pool sized at a tenth of RAM used to be filled with zeros at start, all of it resident before any request:
    its pages now come zeroed from the OS as they are first written. 1 GiB of blocks, one written."""
    spec = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    before = resident_bytes()
    cache = PagedKVCache(spec, CPU, num_blocks=8192, block_size=16)
    assert cache.k.nbytes + cache.v.nbytes > 2**30
    assert resident_bytes() - before < 32 * 2**20
    assert cache.k.data_ptr() % 4096 == 0 and cache.v.data_ptr() % 4096 == 0
    assert not cache.k[:, :3].any() and not cache.v[:, -3:].any()  # zeros where read
    cache.k[:, 5] = 1.0
    assert resident_bytes() - before >= cache.k[:, 5].nbytes
    assert cache.k[:, 5].sum() == cache.k[:, 5].numel() and not cache.k[:, 4].any()
