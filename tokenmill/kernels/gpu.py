"""tokenmill's GPU kernels, in Triton: paged decode attention that reads the block tables itself, RMSNorm with the
residual add, SwiGLU, and RoPE with the KV write, each one launch where torch takes several.

Triton comes with PyTorch's CUDA builds; without it (a CPU build) `available()` is False and the callers keep torch's
own ops. Tests run these kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before this module
is imported: tests/conftest.py) against plain PyTorch.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from tokenmill.kernels import DISABLE_ENV

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: no Triton
    triton = None


@functools.cache
def available() -> bool:
    """Triton is here, and the kernels are not switched off (TOKENMILL_NO_KERNELS, as for the CPU's)."""
    return triton is not None and os.environ.get(DISABLE_ENV, "") in ("", "0")


def runs(x: torch.Tensor) -> bool:
    """Whether x's op takes these kernels: x is on a CUDA device where they work."""
    return x.is_cuda and ready(x.device)


@functools.cache
def ready(device: torch.device) -> bool:
    """The kernels are available and each ran once on this device, on small inputs in fp32 and bf16, to finite
    results; else (a Triton too old for them, a GPU it cannot build for) torch's own ops run, and one log line says
    why. Triton caches what it compiles here, so a later start compiles nothing."""
    if not available():
        return False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            if not all(bool(out.isfinite().all()) for out in _each_kernel(device, dtype)):
                raise RuntimeError(f"a kernel gave non-finite results in {dtype}")
    except Exception as exc:  # a compile or launch error: every cause means the same fallback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("GPU kernels unavailable on %s (%s): torch's own ops, and no CUDA graphs", device, reason[:300])
        return False
    return True


def _each_kernel(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every kernel once on small random inputs (a decode long enough to split, a prefill after a prefix)."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    def ints(*values: int | list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    k_cache, v_cache = rand(41, 16, 2, 64), rand(41, 16, 2, 64)
    tables = torch.arange(1, 41, device=device).view(2, 20)
    block_seq, block_row = prefill_blocks([3, 40])
    cos, sin = rand(2, 1, 32).float(), rand(2, 1, 32).float()
    return [
        paged_decode_attention(rand(2, 4, 64), k_cache, v_cache, tables, ints(300, 7), 0.125),
        paged_prefill_attention(rand(43, 4, 64), k_cache, v_cache, tables, ints(0, 100), ints(0, 3, 43),
                                ints(*block_seq), ints(*block_row), 0.125, window=50),
        rms_norm(rand(3, 64), rand(64), 1e-5, rand(3, 64)),
        silu_mul(rand(3, 128)),
        rope_store_kv(rand(2, 8 * 64), cos, sin, k_cache, v_cache, ints(5, 600), 4, 2),
    ]


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _online_softmax(q, k, v, sees, scale, m_i, l_i, acc, IEEE: tl.constexpr):
        """One tile of keys into a running softmax: the scores of q's rows against k where `sees`, the rows' running
        max m_i and sum l_i, and acc, their weighted values so far. IEEE: in fp32 (tl.dot would round fp32 inputs to
        tf32), which Triton's interpreter needs for bf16 too (its bf16 dot is wrong)."""
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_attention_kernel(
            q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, lse_ptr, scale, window, keys_per_split,
            stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh, stride_os,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """One program: one sequence, one KV head (its GROUP query heads together), one split of the keys. Keys are
        read through the block table, BLOCK_N at a time, with an online softmax. SPLITS > 1 writes each split's
        normalized output and log-sum-exp for _combine_kernel; SPLITS == 1 writes the result."""
        b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lengths_ptr + b)
        first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # a sliding layer: the last `window` keys
        start = split * keys_per_split  # keys_per_split is a multiple of BLOCK_N
        lo = tl.maximum(start, first // BLOCK_N * BLOCK_N)
        hi = tl.minimum(start + keys_per_split, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        q_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):  # every tile holds a key to see: first lies in the first one
            n = n0 + tl.arange(0, BLOCK_N)
            valid = (n < hi) & (n >= first)
            block = tl.load(tables_ptr + b * stride_tb + n // BLOCK_SIZE, mask=n < hi, other=0)
            rows = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            kv_mask = valid[:, None] & (d[None, :] < DIM)
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = _online_softmax(q, k, v, valid[None, :], scale, m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        if SPLITS > 1:  # an empty split's log-sum-exp is -inf: no weight in the combine
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + (b * GROUP * tl.num_programs(1) + heads) * SPLITS + split, lse, mask=g < GROUP)

    @triton.jit
    def _prefill_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, rows_ptr, block_seq_ptr, block_row_ptr, scale,
            window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
            GROUP: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """One program: BLOCK_M query rows of one prefill chunk, one query head. The chunk's rows sit at positions
        start.. of its sequence; each sees the keys up to its own position (the last `window` of them on a sliding
        layer), read through the sequence's block table: the cached prefix and the chunk alike."""
        block, head = tl.program_id(0), tl.program_id(1)
        seq = tl.load(block_seq_ptr + block)
        first_row = tl.load(block_row_ptr + block)
        row0 = tl.load(rows_ptr + seq)
        count = tl.load(rows_ptr + seq + 1) - row0
        start = tl.load(starts_ptr + seq)
        m = first_row + tl.arange(0, BLOCK_M)
        d = tl.arange(0, DIM_PAD)
        positions = start + m
        q_mask = (m[:, None] < count) & (d[None, :] < DIM)
        q = tl.load(q_ptr + (row0 + m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :], mask=q_mask,
                    other=0.0)
        kv_head = head // GROUP
        hi = tl.minimum(start + first_row + BLOCK_M, start + count)  # past the block's last row: no key it sees
        lo = tl.where(window > 0, tl.maximum(start + first_row - window + 1, 0), 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            exists = n < hi
            table_block = tl.load(tables_ptr + seq * stride_tb + n // BLOCK_SIZE, mask=exists, other=0)
            key_rows = table_block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            kv_mask = exists[:, None] & (d[None, :] < DIM)
            k = tl.load(k_ptr + key_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + key_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            sees = exists[None, :] & (n[None, :] <= positions[:, None])
            sees &= (window <= 0) | (n[None, :] > positions[:, None] - window)
            m_i, l_i, acc = _online_softmax(q, k, v, sees, scale, m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (row0 + m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                        SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
        """The splits of one sequence's head, weighted by their share of the softmax's mass."""
        b, head, heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, DIM_PAD)
        lse = tl.load(lse_ptr + (b * heads + head) * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))  # a sequence has a key, so some split's lse is finite
        mask = (s[:, None] < SPLITS) & (d[None, :] < DIM)
        part = tl.load(part_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :], mask=mask,
                       other=0.0)
        out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One row. With a residual, x + residual is rounded to x's dtype and written back into x (the residual
        stream, as torch's x = x + residual would hold it), and the norm is of that sum."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        mask = c < cols
        x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32))
            x = x.to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * stride_x + c, x, mask=mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / cols + eps)
        w = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, cols, BLOCK: tl.constexpr):
        """silu(gate) * up of one row's [gate | up], BLOCK columns a program."""
        row, part = tl.program_id(0), tl.program_id(1)
        c = part * BLOCK + tl.arange(0, BLOCK)
        mask = c < cols
        gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + cols + c, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_store_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_qkv,
                              stride_cos, stride_q, stride_slot, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                              DIM: tl.constexpr, HALF_PAD: tl.constexpr):
        """One token's head: a query head is rotated into q; a KV head's key is rotated and its value copied into the
        pool at the token's slot. Rotate-half RoPE in fp32."""
        token, head = tl.program_id(0), tl.program_id(1)
        half = DIM // 2
        i = tl.arange(0, HALF_PAD)
        mask = i < half
        cos = tl.load(cos_ptr + token * stride_cos + i, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + token * stride_cos + i, mask=mask, other=0.0)
        src = qkv_ptr + token * stride_qkv + head * DIM
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        if head < HEADS:
            dst = q_ptr + token * stride_q + head * DIM
        else:
            slot = tl.load(slots_ptr + token).to(tl.int64)
            dst = k_cache_ptr + slot * stride_slot + (head - HEADS) * DIM
            v_src = src + KV_HEADS * DIM
            v_dst = v_cache_ptr + slot * stride_slot + (head - HEADS) * DIM
            tl.store(v_dst + i, tl.load(v_src + i, mask=mask), mask=mask)
            tl.store(v_dst + half + i, tl.load(v_src + half + i, mask=mask), mask=mask)
        tl.store(dst + i, r1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + i, r2.to(q_ptr.dtype.element_ty), mask=mask)


KEYS_PER_SPLIT = 256  # the fewest keys a split takes (a multiple of BLOCK_N)
BLOCK_N = 64
MAX_SPLITS = 32


def decode_splits(batch: int, kv_heads: int, max_keys: int) -> int:
    """Split the keys where the batch's programs alone leave the GPU's multiprocessors idle: a fixed count for a
    given shape (a CUDA graph replays it), splits past a sequence's length exit at once."""
    if batch * kv_heads >= 256:
        return 1
    return max(1, min(MAX_SPLITS, -(-max_keys // KEYS_PER_SPLIT)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [b, heads, dim], one query per row; k/v_cache: [blocks, block size, kv heads, dim]; tables: [b, width]
    block ids; lengths: [b] keys each row sees (>= 1). window > 0: only the last `window` keys."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = decode_splits(b, kv_heads, tables.shape[1] * block_size)
    keys_per_split = -(-tables.shape[1] * block_size // splits // BLOCK_N) * BLOCK_N
    out = torch.empty_like(q)
    part, lse = out[:, :, None], out  # SPLITS == 1: the result directly (lse unused)
    if splits > 1:
        part = torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _decode_attention_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, tables, lengths, part, lse, scale, window, keys_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        GROUP=group, GROUP_PAD=max(16, _pow2(group)), DIM=dim, DIM_PAD=max(16, _pow2(dim)), BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N, SPLITS=splits, IEEE=q.dtype == torch.float32 or _INTERPRETING)
    if splits > 1:
        _combine_kernel[(b, heads)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
                                    out.stride(1), SPLITS=splits, SPLITS_PAD=max(2, _pow2(splits)), DIM=dim,
                                    DIM_PAD=_pow2(dim))
    return out


PREFILL_BLOCK_M = 32  # query rows a prefill program takes


def prefill_blocks(rows: list[int]) -> tuple[list[int], list[int]]:
    """For paged_prefill_attention: each program's chunk and first row, over chunks of rows[i] query rows."""
    seq: list[int] = []
    first: list[int] = []
    for i, n in enumerate(rows):
        starts = range(0, n, PREFILL_BLOCK_M)
        seq += [i] * len(starts)
        first += starts
    return seq, first


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                            starts: torch.Tensor, rows: torch.Tensor, block_seq: torch.Tensor,
                            block_row: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Prefill chunks of several sequences in one launch. q: [tokens, heads, dim], the chunks one after another;
    tables: [chunks, width] block ids; starts: [chunks] the position of each chunk's first row; rows: [chunks + 1]
    where each chunk's rows begin in q (and the end); block_seq, block_row: prefill_blocks' map of the programs."""
    heads, dim = q.shape[1], q.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    _prefill_attention_kernel[(block_seq.shape[0], heads)](
        q, k_cache, v_cache, out, tables, starts, rows, block_seq, block_row, scale, window, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        GROUP=heads // k_cache.shape[2], DIM=dim, DIM_PAD=max(16, _pow2(dim)), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32 or _INTERPRETING)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows [tokens, cols]; with residual, of x + residual, which is written into x."""
    out = torch.empty_like(x)
    r = x if residual is None else residual
    _rms_norm_kernel[(x.shape[0],)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), x.shape[1], eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=_pow2(x.shape[1]))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * cols] (gate | up) -> silu(gate) * up, [tokens, cols]."""
    tokens, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(cols))
    _silu_mul_kernel[(tokens, -(-cols // block))](gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block)
    return out


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """From q|k|v [tokens, (heads + 2 kv heads) * dim]: the rotated queries [tokens, heads, dim]; rotated keys and
    the values written into the pool [blocks, block size, kv heads, dim] at slots (flat block * size + offset).
    cos, sin: [tokens, 1, dim / 2] fp32, as RotaryEmbedding gives them."""
    tokens = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kv_kernel[(tokens, heads + kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HALF_PAD=_pow2(dim // 2))
    return q
