"""tokenmill's Triton kernels; kernels/gpu.py launches them. A module of its own, imported on first use: importing
Triton slows the CPU path's decode (docs/performance/tuning.md), so a CPU run never does."""

import triton
import triton.language as tl


@triton.jit
def online_softmax(q, k, v, sees, scale, m_i, l_i, acc, IEEE: tl.constexpr):
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
def wait_for_inputs(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL, gpu.pdl_ready), a kernel starts while the one before it finishes: wait
    for that one's writes (and so, each kernel waiting in turn, for every earlier one's) before reading or writing
    anything a kernel writes, then let the next kernel start. Only weights, which no kernel writes, are read before."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

@triton.jit
def load_kv(pool_ptr, scales_ptr, rows, d, row_mask, mask, DIM: tl.constexpr, QUANT: tl.constexpr):
    """A tile of a KV pool's rows (rows: each one's first element; d: the columns): as the pool holds them, or a
    quantized pool's numbers (QUANT 1: int8; 2: e4m3, read as bytes) times each row's scale, the fp32 after its DIM
    numbers (scales_ptr: the pool read as fp32; layers/kv_quant.py's layout)."""
    x = tl.load(pool_ptr + rows[:, None] + d[None, :], mask=mask, other=0)
    if QUANT:
        if QUANT == 2:
            x = x.to(tl.float8e4nv, bitcast=True)
        scale = tl.load(scales_ptr + (rows + DIM) // 4, mask=row_mask, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    return x


@triton.jit(do_not_specialize=["keys_per_split", "splits", "stride_tb"])  # they vary with the step's longest context
def decode_attention(
        q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, lengths_ptr, out_ptr, lse_ptr, scale, window,
        keys_per_split, splits,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh, stride_os,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
        PDL: tl.constexpr):
    """One program: one sequence, one KV head (its GROUP query heads together), one split of the keys. Keys are
    read through the block table, BLOCK_N at a time (QUANT: from a quantized pool, load_kv), with an online
    softmax. splits > 1 writes each split's normalized output and log-sum-exp for combine_splits; splits == 1
    writes the result. Neither splits nor the table's width is a constexpr or specialized on: a step op by op,
    whose counts grow with its longest context, reuses one compiled kernel (as constexprs, a growing context
    compiled 39 of them)."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_inputs(PDL)
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
        k = load_kv(k_ptr, k_scales_ptr, rows, d, valid, kv_mask, DIM, QUANT).to(q.dtype)
        v = load_kv(v_ptr, v_scales_ptr, rows, d, valid, kv_mask, DIM, QUANT).to(q.dtype)
        m_i, l_i, acc = online_softmax(q, k, v, valid[None, :], scale, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if splits > 1:  # an empty split's log-sum-exp is -inf: no weight in the combine
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * GROUP * tl.num_programs(1) + heads) * splits + split, lse, mask=g < GROUP)

@triton.jit(do_not_specialize=["stride_tb"])
def prefill_attention(
        q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, out_ptr, tables_ptr, starts_ptr, rows_ptr, block_seq_ptr,
        block_row_ptr, scale, window, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
        GROUP: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_M query rows of one prefill chunk, one query head. The chunk's rows sit at positions
    start.. of its sequence; each sees the keys up to its own position (the last `window` of them on a sliding
    layer), read through the sequence's block table: the cached prefix and the chunk alike (QUANT: from a
    quantized pool, load_kv)."""
    block, head = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
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
        k = load_kv(k_ptr, k_scales_ptr, key_rows, d, exists, kv_mask, DIM, QUANT).to(q.dtype)
        v = load_kv(v_ptr, v_scales_ptr, key_rows, d, exists, kv_mask, DIM, QUANT).to(q.dtype)
        sees = exists[None, :] & (n[None, :] <= positions[:, None])
        sees &= (window <= 0) | (n[None, :] > positions[:, None] - window)
        m_i, l_i, acc = online_softmax(q, k, v, sees, scale, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row0 + m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)

@triton.jit(do_not_specialize=["splits"])
def combine_splits(part_ptr, lse_ptr, out_ptr, splits, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                   SPLITS_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, PDL: tl.constexpr):
    """The splits of one sequence's head, weighted by their share of the softmax's mass. SPLITS_PAD: the most
    splits there can be, so every count shares one kernel."""
    b, head, heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    wait_for_inputs(PDL)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    lse = tl.load(lse_ptr + (b * heads + head) * splits + s, mask=s < splits, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # a sequence has a key, so some split's lse is finite
    mask = (s[:, None] < splits) & (d[None, :] < DIM)
    part = tl.load(part_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :], mask=mask,
                   other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)

@triton.jit
def rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row. With a residual, x + residual is rounded to x's dtype and written back into x (the residual
    stream, as torch's x = x + residual would hold it), and the norm is of that sum."""
    row = tl.program_id(0)
    wait_for_inputs(PDL)
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
def silu_mul(x_ptr, out_ptr, stride_x, stride_o, cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """silu(gate) * up of one row's [gate | up], BLOCK columns a program."""
    row, part = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    c = part * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + cols + c, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def round_half_even(x):
    """x (fp32, |x| < 2^22) to the nearest integer, ties to even (torch.round's), as fp32."""
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & (r % 2 != 0), r - 1, r)


@triton.jit
def e4m3_grid(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32 (its conversion to e4m3 is then
    exact: Triton's interpreter rounds wrongly where a rounding carries into the exponent). Normal values keep 3
    mantissa bits; below 2^-6, multiples of 2^-9 (e4m3's subnormals), the sign kept for zero."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    tiny = round_half_even(tl.abs(x) * 512.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -tiny, tiny), normal)


@triton.jit
def store_kv_row(pool_ptr, scales_ptr, row, i, mask, x1, x2, HALF: tl.constexpr, LARGEST: tl.constexpr):
    """A KV head's row of a token (its halves x1, x2, fp32) into the pool at element `row`: in the pool's dtype, or
    (LARGEST > 0) quantized as layers/kv_quant.py's quantize writes it: the numbers x / scale (127: int8, rounded
    to nearest, ties to even; 448: e4m3), then scale = amax / LARGEST (scales_ptr: the pool read as fp32)."""
    if LARGEST > 0:
        scale = tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0)) / LARGEST
        safe = tl.where(scale > 0, scale, 1.0)
        x1 = tl.where(scale > 0, x1 / safe, 0.0)
        x2 = tl.where(scale > 0, x2 / safe, 0.0)
        if LARGEST == 127.0:
            x1 = round_half_even(x1)
            x2 = round_half_even(x2)
        else:
            x1 = e4m3_grid(x1)
            x2 = e4m3_grid(x2)
        tl.store(scales_ptr + (row + 2 * HALF) // 4, scale)
    tl.store(pool_ptr + row + i, x1.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(pool_ptr + row + HALF + i, x2.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_store_kv(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                          slots_ptr, stride_qkv, stride_cos, stride_q, stride_slot, stride_kh,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                          LARGEST: tl.constexpr, PDL: tl.constexpr):
    """One token's head: a query head is rotated into q; a KV head's key is rotated (and rounded to the compute
    dtype, q's) and its value copied into the pool at the token's slot (store_kv_row; LARGEST > 0: a quantized
    pool). Rotate-half RoPE in fp32."""
    token, head = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    half = DIM // 2
    i = tl.arange(0, HALF_PAD)
    mask = i < half
    cos = tl.load(cos_ptr + token * stride_cos + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_cos + i, mask=mask, other=0.0)
    src = qkv_ptr + token * stride_qkv + head * DIM
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    if head < HEADS:
        dst = q_ptr + token * stride_q + head * DIM
        tl.store(dst + i, r1, mask=mask)
        tl.store(dst + half + i, r2, mask=mask)
    else:
        row = tl.load(slots_ptr + token).to(tl.int64) * stride_slot + (head - HEADS) * stride_kh
        store_kv_row(k_cache_ptr, k_scales_ptr, row, i, mask, r1.to(tl.float32), r2.to(tl.float32), DIM // 2,
                     LARGEST)
        v_src = src + KV_HEADS * DIM
        v1 = tl.load(v_src + i, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + half + i, mask=mask, other=0.0).to(tl.float32)
        store_kv_row(v_cache_ptr, v_scales_ptr, row, i, mask, v1, v2, DIM // 2, LARGEST)

@triton.jit
def weight_tile(w_ptr, scales_ptr, mins_ptr, n, n_mask, k0, cols, stride_w, stride_s, BITS: tl.constexpr,
                SUB: tl.constexpr, ZERO: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] in fp32: rows n [BLOCK_N] (where n_mask), columns k0.. (below cols). BITS 0: a dense
    matrix. Else a quantized one as gpu.QuantizedRows lays it out: per row, its blocks of 32 weights one after
    another, each 16 bytes of nibbles (weight i in the low nibble of byte i, 16 + i in the high one) then, for 5 bits,
    4 bytes of fifth bits (weight 4c + j in bit 2c of byte j, 16 + 4c + j in bit 2c + 1) or, for 6 bits, 8 bytes of
    top two bits (weights 4c + j in bits 2c, 2c + 1 of byte j, and 16 + 4c + j of byte 4 + j); 8 bits: one signed
    byte a weight. A weight is (q - ZERO) * scale (+ min), a scale (and min) per SUB weights."""
    codes, high, scales, mins = weight_parts(w_ptr, scales_ptr, mins_ptr, n, n_mask, k0, cols, stride_w, stride_s,
                                             BITS, SUB, HAS_MINS, BLOCK_K)
    return weight_values(codes, high, scales, mins, BITS, ZERO, HAS_MINS, BLOCK_N, BLOCK_K)

@triton.jit
def weight_parts(w_ptr, scales_ptr, mins_ptr, n, n_mask, k0, cols, stride_w, stride_s, BITS: tl.constexpr,
                 SUB: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_K: tl.constexpr):
    """weight_tile's loads, as the memory holds them: the dense tile (BITS 0), or a quantized tile's bytes, its 5- or
    6-bit planes, scales and mins, built as [rows, blocks, halves, 16] so a block's bytes and each half's scale are
    loaded once, not once a weight (quantized tiles are whole blocks: k0 and BLOCK_K multiples of 32, as cols is).
    A part the layout lacks is a zero. A quantized tile's parts take fewer registers than its values (row_matmul holds
    them across its wait); a dense tile is converted to fp32 as it loads (fewer registers so, measured by ptxas)."""
    none = tl.zeros([1, 1, 1, 1], tl.int8)
    if BITS == 0:
        k = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                        mask=n_mask[:, None] & (k < cols)[None, :], other=0.0).to(tl.float32)
        high, scales, mins = none, none, none
    else:
        rows = n.to(tl.int64)[:, None, None, None]
        first = (k0 + 32 * tl.arange(0, BLOCK_K // 32))[None, :, None, None]  # each block's first column
        half = tl.arange(0, 2)[None, None, :, None]
        i = tl.arange(0, 16)[None, None, None, :]
        mask = n_mask[:, None, None, None] & (first < cols)
        high = none
        if BITS == 8:
            codes = tl.load(w_ptr + rows * stride_w + first + 16 * half + i, mask=mask, other=0)
        else:
            block = w_ptr + rows * stride_w + first // 32 * (4 * BITS)
            codes = tl.load(block + i, mask=mask, other=0)
            if BITS == 5:
                high = tl.load(block + 16 + i % 4, mask=mask, other=0)
            if BITS == 6:
                high = tl.load(block + 16 + 4 * half + i % 4, mask=mask, other=0)
        scale = rows * stride_s + (first + 16 * half) // SUB
        scales = tl.load(scales_ptr + scale, mask=mask, other=0.0)
        mins = tl.load(mins_ptr + scale, mask=mask, other=0.0) if HAS_MINS else none
    return codes, high, scales, mins

@triton.jit
def weight_values(codes, high, scales, mins, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_MINS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """weight_parts' tile as fp32 weights [BLOCK_N, BLOCK_K]."""
    if BITS == 0:
        w = codes.to(tl.float32)
    else:
        half = tl.arange(0, 2)[None, None, :, None]
        i = tl.arange(0, 16)[None, None, None, :]
        if BITS == 8:
            q = codes.to(tl.int32)
        else:
            q = (codes.to(tl.int32) >> (4 * half)) & 15
            if BITS == 5:
                q |= ((high.to(tl.int32) >> (2 * (i // 4) + half)) & 1) << 4
            if BITS == 6:
                q |= ((high.to(tl.int32) >> (2 * (i // 4))) & 3) << 4
        w = (q - ZERO).to(tl.float32) * scales.to(tl.float32)
        if HAS_MINS:
            w += mins.to(tl.float32)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return w

@triton.jit
def dequantize(w_ptr, scales_ptr, mins_ptr, index_ptr, out_ptr, n_rows, cols, stride_w, stride_s, stride_o,
               BITS: tl.constexpr, SUB: tl.constexpr, ZERO: tl.constexpr, HAS_MINS: tl.constexpr,
               HAS_INDEX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Rows of a quantized matrix (weight_tile's layout) in out's dtype: row r of out is row index[r] (HAS_INDEX:
    an embedding's lookup) or row r."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_mask = r < n_rows
    wait_for_inputs(PDL)  # the index: a step's input
    source = tl.load(index_ptr + r, mask=r_mask, other=0) if HAS_INDEX else r
    w = weight_tile(w_ptr, scales_ptr, mins_ptr, source, r_mask, tl.program_id(1) * BLOCK_K, cols, stride_w,
                    stride_s, BITS, SUB, ZERO, HAS_MINS, BLOCK_N, BLOCK_K)
    mask = r_mask[:, None] & (k < cols)[None, :]
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def row_matmul(x_ptr, residual_ptr, norm_ptr, w_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, sum_ptr, rows, cols,
               n_out, eps, stride_x, stride_r, stride_sum, stride_o, stride_w, stride_s,
               PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, SUB: tl.constexpr,
               ZERO: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out = a @ w.T (+ bias) for a few rows (a decode step of few sequences), BLOCK_N of w's rows a program, every
    row of the step in it (BLOCK_M: rows, padded), w dense or quantized (weight_tile), where a is x after a prologue
    that would otherwise be a kernel of its own:
    PROLOGUE 0: x; 1: RMSNorm(x) * norm; 2: RMSNorm(x + residual) * norm, the sum (rounded to x's dtype, as the
    residual stream holds it) written into sum_ptr by the first program; 3: silu(gate) * up and 4: gelu_tanh(gate)
    * up of x = [gate | up] (cols each). Each prologue's result is rounded to x's dtype, as the op it replaces would
    store it, then multiplied in fp32 sums. BLOCK_K is best all of cols: each pass of the loop waits for its
    loads. With PDL the first pass's weights are loaded before waiting for the kernel before (wait_for_inputs), as
    it finishes, and decoded after."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    m = tl.arange(0, BLOCK_M)
    m_mask = m < rows
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None] * stride_x
    r_rows = residual_ptr + m[:, None] * stride_r
    if PDL:  # the first pass's weights load while the kernel before finishes
        codes, high, scales, mins = weight_parts(w_ptr, scales_ptr, mins_ptr, n, n_mask, 0, cols, stride_w,
                                                 stride_s, BITS, SUB, HAS_MINS, BLOCK_K)
    wait_for_inputs(PDL)
    if PROLOGUE == 1 or PROLOGUE == 2:
        squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            mask = m_mask[:, None] & (k < cols)
            a = tl.load(x_rows + k, mask=mask, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                a = (a + tl.load(r_rows + k, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            squares += a * a
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 1) / cols + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < cols
        # With PDL the first pass's parts came before the wait; each later pass loads its own. (Without, every pass
        # loads here: parts defined before the loop would be carried through it, costing registers.)
        if PDL:
            if k0 > 0:
                codes, high, scales, mins = weight_parts(w_ptr, scales_ptr, mins_ptr, n, n_mask, k0, cols,
                                                         stride_w, stride_s, BITS, SUB, HAS_MINS, BLOCK_K)
        else:
            codes, high, scales, mins = weight_parts(w_ptr, scales_ptr, mins_ptr, n, n_mask, k0, cols, stride_w,
                                                     stride_s, BITS, SUB, HAS_MINS, BLOCK_K)
        w = weight_values(codes, high, scales, mins, BITS, ZERO, HAS_MINS, BLOCK_N, BLOCK_K)
        mask = m_mask[:, None] & k_mask[None, :]
        a = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if PROLOGUE == 2:
            a = (a + tl.load(r_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(sum_ptr + m[:, None] * stride_sum + k[None, :], a, mask=mask)
            a = a.to(tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:
            a = a * rstd[:, None] * tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        if PROLOGUE == 3 or PROLOGUE == 4:
            up = tl.load(x_rows + cols + k[None, :], mask=mask, other=0.0).to(tl.float32)
            if PROLOGUE == 3:
                a = a / (1.0 + tl.exp(-a)) * up
            else:  # tanh(y) = 1 - 2 / (exp(2y) + 1)
                y = 0.7978845608028654 * (a + 0.044715 * a * a * a)
                a = 0.5 * a * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * up
        a = a.to(dtype).to(tl.float32)
        if BLOCK_M == 1:  # one row: [1, BLOCK_K] against the tile, no third dimension
            acc += tl.sum(a * w, 1)[None, :]
        else:
            acc += tl.sum(a[:, None, :] * w[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
