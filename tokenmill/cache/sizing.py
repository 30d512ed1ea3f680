"""How much KV memory a server gets, and the cache built from it."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import torch

from tokenmill import backend
from tokenmill.cache.kv_cache import AttentionPaths, ContiguousKVCache, KVCache, KVSpec, PagedKVCache
from tokenmill.config import EngineConfig, parse_size
from tokenmill.errors import ConfigError
from tokenmill.layers import kv_quant

log = logging.getLogger(__name__)


def available_memory() -> int:
    """The RAM available now: MemAvailable, which counts the page cache the kernel would give back (the sysconf
    fallback, for systems without /proc, does not)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.85)
    return available_memory() // 10  # on CPU the KV pool shares RAM with everything else


def build_kv_cache(config: EngineConfig, spec: KVSpec, device: torch.device, max_model_len: int,
                   agree: Callable[[int], int] = int) -> KVCache:
    """Size KV memory from config.kv_cache_memory or the free memory, never beyond what --max-num-seqs contexts of
    max_model_len tokens need; agree: the block counts every tensor-parallel rank takes, from this rank's (the
    smallest of them: each rank's pool holds the same blocks)."""
    budget = parse_size(config.kv_cache_memory) if config.kv_cache_memory else _available_memory(device)
    max_tokens_needed = config.max_num_seqs * max_model_len
    cache: KVCache
    if config.kv == "paged":
        num_blocks, sliding_blocks = map(agree, _paged_blocks(config, spec, budget, max_model_len))
        if num_blocks < 1:
            raise ConfigError(f"KV memory of {budget} bytes holds no block of {config.block_size} tokens")
        paths = AttentionPaths(config.deterministic, config.cpu_prefill_attention, prefill_on(config, spec, device))
        cache = PagedKVCache(spec, device, num_blocks, config.block_size, config.prefix_caching, sliding_blocks, paths)
    else:  # contiguous (EngineConfig.check() refuses other layouts, and deterministic mode with this one)
        if config.prefix_caching:
            log.info("prefix caching needs the paged layout: off with --kv contiguous")
        cache = ContiguousKVCache(spec, device, min(budget // spec.bytes_per_token, max_tokens_needed))
    if isinstance(cache, PagedKVCache) and cache.sliding is not None:
        full_layers, sliding = spec.num_layers - spec.num_sliding, cache.sliding.blocks.num_blocks * config.block_size
        log.info("KV cache: paged, %.2f GiB for %d tokens of the %d global layers and %d of the %d sliding layers, "
                 "which keep only their last %d (--no-sliding-window-kv: every layer keeps every token)",
                 (cache.capacity_tokens * full_layers + sliding * spec.num_sliding) * spec.layer_bytes_per_token
                 / 2**30, cache.capacity_tokens, full_layers, sliding, spec.num_sliding, spec.window)
    else:
        log.info("KV cache: %s, %.2f GiB for %d tokens (%d bytes per token)", config.kv,
                 cache.capacity_tokens * spec.bytes_per_token / 2**30, cache.capacity_tokens, spec.bytes_per_token)
    if kv_quant.is_quantized(spec.dtype):
        wide = dataclasses.replace(spec, dtype=torch.bfloat16)
        log.info("KV cache in %s with a scale per token and KV head: %.2fx the tokens of a bf16 cache in the same "
                 "memory", config.kv_cache_dtype, wide.bytes_per_token / spec.bytes_per_token)
    return cache


def prefill_on(config: EngineConfig, spec: KVSpec, device: torch.device) -> str:
    """What a pool of spec's prompt chunks multiply on in the CPU's prefill kernel (AttentionPaths.prefill_on)."""
    if not (spec.dtype == torch.bfloat16 and config.cpu_prefill_attention and backend.cpu_kernels(device)):
        return "fp32"
    return backend.bf16_prefill_attention(device, config.bf16_pair_attention, config.amx_attention)


def _paged_blocks(config: EngineConfig, spec: KVSpec, budget: int, max_model_len: int) -> tuple[int, int]:
    """Blocks of the pool of every layer (or of the global layers, with sliding-window layers), and of the sliding
    layers' own pool (0: none). That one holds the windows of --max-num-seqs sequences and one step's prompt tokens
    (without chunked prefill, a whole prompt's: one longer than the step's budget runs alone), and never more blocks
    than the other: a sequence holds at most as many sliding blocks as global ones. The rest of the budget goes to
    the global layers, up to what --max-num-seqs contexts of max_model_len tokens need."""
    bs = config.block_size
    cap = -(-config.max_num_seqs * max_model_len // bs)
    if not (config.sliding_window_kv and spec.num_sliding):
        return min(budget // (bs * spec.bytes_per_token), cap), 0
    sliding_block = bs * spec.num_sliding * spec.layer_bytes_per_token
    full_block = bs * (spec.num_layers - spec.num_sliding) * spec.layer_bytes_per_token
    # The keys a token sees through the window straddle at most this many blocks, its own included.
    per_sequence = (spec.window - 1) // bs + 2
    step_tokens = config.max_num_batched_tokens if config.chunked_prefill else max(config.max_num_batched_tokens,
                                                                                   max_model_len)
    sliding = min(config.max_num_seqs * per_sequence + -(-step_tokens // bs), cap)
    if budget < sliding * (sliding_block + full_block):  # no room to spare: as many blocks in each pool
        return (blocks := budget // (sliding_block + full_block)), blocks
    full = cap if not full_block else min(cap, (budget - sliding * sliding_block) // full_block)
    return full, sliding
