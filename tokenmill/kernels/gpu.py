"""tokenmill's GPU kernels (kernels/triton_kernels.py) and their launches: paged decode and prefill attention that
read the block tables themselves, RMSNorm with the residual add, SwiGLU, RoPE with the KV write, and a matmul of few
rows with the norm or SwiGLU before it fused in (row_matmul), each one launch where torch takes several; and GGUF's
quantized matrices kept so on the GPU (QuantizedRows): row_matmul dequantizes them as it reads them, and
QuantizedRows.dequantize for cuBLAS's matmuls of more rows and for embedding lookups.

Triton comes with PyTorch's CUDA builds; without it (a CPU build) `available()` is False and the callers keep torch's
own ops. Tests run these kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported: tests/conftest.py) against plain PyTorch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from tokenmill.kernels import DISABLE_ENV

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Triton is installed (not imported: see _kernels), and the kernels are not switched off (TOKENMILL_NO_KERNELS,
    as for the CPU's)."""
    return importlib.util.find_spec("triton") is not None and os.environ.get(DISABLE_ENV, "") in ("", "0")


def _kernels() -> ModuleType:
    """The Triton kernels, imported on first use (kernels/triton_kernels.py says why)."""
    from tokenmill.kernels import triton_kernels

    return triton_kernels


def runs(x: torch.Tensor) -> bool:
    """Whether x's op takes these kernels: x is on a CUDA device where they work. Checked before the CPU's kernels
    (tests/model/test_gpu_path.py runs the model through these on the CPU by making it True)."""
    return x.is_cuda and ready(x.device)


def serves(device: torch.device) -> bool:
    """runs() for the tensors a step will put on device."""
    return device.type == "cuda" and ready(device)


@functools.cache
def ready(device: torch.device) -> bool:
    """The kernels are available and each ran once on this device, on small inputs in fp32 and bf16, to finite
    results; else (a Triton too old for them, a GPU it cannot build for) torch's own ops run, and one log line says
    why. Triton caches what it compiles here, so a later start compiles nothing."""
    if not available():
        return False
    try:
        with _pdl_forced(pdl=False):
            for dtype in (torch.float32, torch.bfloat16):
                if not all(bool(out.isfinite().all()) for out in _each_kernel(device, dtype)):
                    raise RuntimeError(f"a kernel gave non-finite results in {dtype}")
    except Exception as exc:  # a compile or launch error: every cause means the same fallback
        log.warning("GPU kernels unavailable on %s (%s): torch's own ops, and no CUDA graphs", device, _reason(exc))
        return False
    pdl_ready(device)  # probed now, before any CUDA graph is captured
    return True


def _reason(exc: Exception) -> str:
    return (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:300]


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
    codes = torch.randint(0, 256, (40, 32), dtype=torch.uint8, generator=generator).to(device)
    quantized = QuantizedRows(codes, rand(40, 2), rand(40, 2), 8, 32, 4)  # Q4_1's layout
    return [
        paged_decode_attention(rand(2, 4, 64), k_cache, v_cache, tables, ints(300, 7), 0.125),
        paged_prefill_attention(rand(43, 4, 64), k_cache, v_cache, tables, ints(0, 100), ints(0, 3, 43),
                                ints(*block_seq), ints(*block_row), 0.125, window=50),
        rms_norm(rand(3, 64), rand(64), 1e-5, rand(3, 64)),
        silu_mul(rand(3, 128)),
        rope_store_kv(rand(2, 8 * 64), cos, sin, k_cache, v_cache, ints(5, 600), 4, 2),
        row_matmul(rand(1, 64), rand(40, 64), rand(40), "add_norm", rand(64), 1e-5, rand(1, 64))[0],
        row_matmul(rand(1, 128), rand(40, 64), None, "silu_mul")[0],
        row_matmul(rand(3, 64), quantized, None, "norm", rand(64), 1e-5)[0],
        quantized.dequantize(dtype, ints(5, 0, 39)),
    ]


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"

# Programmatic dependent launch (PDL): on a GPU of sm_90 or newer, a kernel launched so starts while the one before
# it finishes, and waits in itself (triton_kernels.wait_for_inputs) before reading what that one writes. A
# one-stream decode step is a chain of ~200 short kernels, each of which otherwise starts only when the last has
# ended; row_matmul reads its weights before its wait, as the kernel before finishes.
_pdl = [True]  # the A/B switch: EngineConfig.gpu_pdl (Engine._setup)
_forced_pdl: list[bool | None] = [None]  # set by _pdl_forced: the probes, and the compile tests


def use_pdl(on: bool) -> None:
    _pdl[0] = on


@contextlib.contextmanager
def _pdl_forced(pdl: bool) -> Iterator[None]:
    """Launch the kernels with PDL or without, whatever the switch and the device."""
    _forced_pdl[0] = pdl
    try:
        yield
    finally:
        _forced_pdl[0] = None


def _pdl_options(device: torch.device) -> dict[str, bool]:
    """Every launch's PDL options: the kernel's constexpr, and with it Triton's launch flag (a kernel launched so
    must wait in itself), which a Triton older than 3.4 lacks and refuses: passed only when on."""
    on = _forced_pdl[0] if _forced_pdl[0] is not None else _pdl[0] and pdl_ready(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def pdl_ready(device: torch.device) -> bool:
    """Whether the kernels can launch with PDL here: a CUDA GPU of sm_90 or newer (Hopper's griddepcontrol), on
    which a chain of them launched so (a decode layer's row_matmul, RoPE with the KV write, attention with its
    combine, row_matmul), eager and replayed in a CUDA graph on new inputs, gives their plain launches' results;
    else they launch plainly, and one log line says why. Called by ready(), so before any graph is captured."""
    if _INTERPRETING or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        chain, x = _decode_chain(device)
        inputs = [torch.randn_like(x) for _ in range(3)]
        with _pdl_forced(pdl=False):
            expected = [chain(i) for i in inputs]
        with _pdl_forced(pdl=True):
            eager = chain(inputs[0])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = chain(x)
        results = [eager]
        for i in inputs[1:]:
            x.copy_(i)
            graph.replay()
            results.append([t.clone() for t in replayed])
        torch.cuda.synchronize(device)
        # within a bf16 rounding (a compiler may order sums otherwise); a read before its wait would see the
        # previous input's values
        if not all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
                   for want, got in zip(expected, results, strict=True) for a, b in zip(want, got, strict=True)):
            raise RuntimeError("launched so, the kernels gave other results")
    except Exception as exc:  # a launch flag this Triton lacks, a failed capture, other results
        log.warning("programmatic dependent launch unavailable on %s (%s): each kernel starts when the one "
                    "before has ended", device, _reason(exc))
        return False
    return True


def _decode_chain(device: torch.device) -> tuple[Callable[[torch.Tensor], list[torch.Tensor]], torch.Tensor]:
    """pdl_ready's chain: a function of x [1, 64] (bf16) through the kernels of a decode layer (2 heads, 1 KV head
    of 32, a context of 601 keys, so the keys split), and an x to capture it with."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    k_cache, v_cache = rand(41, 16, 1, 32), rand(41, 16, 1, 32)
    tables = torch.arange(1, 41, device=device).view(1, 40)
    lengths = torch.tensor([601], device=device)
    slots = tables[:, 600 // 16] * 16 + 600 % 16
    cos, sin = rand(1, 1, 16).float(), rand(1, 1, 16).float()
    residual, norm, w_qkv, w_out = rand(1, 64), rand(64), rand(128, 64), rand(64, 32)

    def chain(x: torch.Tensor) -> list[torch.Tensor]:
        qkv, stream = row_matmul(x, w_qkv, None, "add_norm", norm, 1e-5, residual)
        q = rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, 2, 1)
        attention = paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)
        assert stream is not None  # add_norm's
        return [stream, row_matmul(attention.view(1, 64), w_out, None, "silu_mul")[0]]

    return chain, rand(1, 64)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


KEYS_PER_SPLIT = 256  # the fewest keys a split takes (a multiple of any key tile)
MAX_SPLITS = 32  # a power of two: combine_splits loads that many, masked


def _key_tile(dim: int, dtype: torch.dtype) -> int:
    """Keys an attention program loads at a time: 64 of a 64-wide bf16 head, fewer of a wider head or in fp32, so
    its pipelined K and V tiles stay within a consumer GPU's shared memory (99 KB on sm_86 and sm_89; a 256-wide
    head at 64 keys took 152 KB in fp32). At least 16: tl.dot's smallest side."""
    return max(16, min(64, 8192 // (max(16, _pow2(dim)) * dtype.itemsize)))


def _ieee(dtype: torch.dtype) -> bool:
    """Attention's dots in fp32: fp32 inputs (else tl.dot would round them to tf32), or the interpreter, whose bf16
    dot is wrong (triton_kernels.online_softmax)."""
    return dtype == torch.float32 or _INTERPRETING


def _quantized(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A KV pool as the attention kernels read it (triton_kernels.load_kv): its numbers (an e4m3 pool's as bytes),
    the pool read as fp32 (a quantized pool's rows' scales, layers/kv_quant.py), and its kind: 0 the compute
    dtype's values, 1 int8, 2 e4m3."""
    if pool.element_size() != 1:
        return pool, pool, 0
    e4m3 = pool.dtype == torch.float8_e4m3fn
    return (pool.view(torch.uint8) if e4m3 else pool), pool.view(torch.float32), 2 if e4m3 else 1


def decode_splits(batch: int, kv_heads: int, max_keys: int) -> int:
    """Split the keys where the batch's programs alone leave the GPU's multiprocessors idle: a fixed count for a
    given shape (a CUDA graph replays it), splits past a sequence's length exit at once."""
    if batch * kv_heads >= 256:
        return 1
    return max(1, min(MAX_SPLITS, -(-max_keys // KEYS_PER_SPLIT)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [b, heads, dim], one query per row; k/v_cache: [blocks, block size, kv heads, dim] (a quantized pool's:
    dim + 4, layers/kv_quant.py); tables: [b, width] block ids; lengths: [b] keys each row sees (>= 1). window > 0:
    only the last `window` keys."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = decode_splits(b, kv_heads, tables.shape[1] * block_size)
    block_n = _key_tile(dim, q.dtype)
    keys_per_split = -(-tables.shape[1] * block_size // splits // block_n) * block_n
    out = torch.empty_like(q)
    part, lse = out[:, :, None], out  # SPLITS == 1: the result directly (lse unused)
    if splits > 1:
        part = torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    (k_numbers, k_scales, quantized), (v_numbers, v_scales, _) = _quantized(k_cache), _quantized(v_cache)
    _kernels().decode_attention[(b, kv_heads, splits)](
        q, k_numbers, v_numbers, k_scales, v_scales, tables, lengths, part, lse, scale, window, keys_per_split, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        GROUP=group, GROUP_PAD=max(16, _pow2(group)), DIM=dim, DIM_PAD=max(16, _pow2(dim)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, IEEE=_ieee(q.dtype), QUANT=quantized, **_pdl_options(q.device))
    if splits > 1:
        _kernels().combine_splits[(b, heads)](
            part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
            SPLITS_PAD=MAX_SPLITS, DIM=dim, DIM_PAD=_pow2(dim), **_pdl_options(q.device))
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
    (k_numbers, k_scales, quantized), (v_numbers, v_scales, _) = _quantized(k_cache), _quantized(v_cache)
    _kernels().prefill_attention[(block_seq.shape[0], heads)](
        q, k_numbers, v_numbers, k_scales, v_scales, out, tables, starts, rows, block_seq, block_row, scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        GROUP=heads // k_cache.shape[2], DIM=dim, DIM_PAD=max(16, _pow2(dim)), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=_key_tile(dim, q.dtype), IEEE=_ieee(q.dtype), QUANT=quantized,
        num_warps=8 if dim > 128 else 4,  # a wide head's accumulator: 4 warps spilled registers in fp32
        **_pdl_options(q.device))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows [tokens, cols]; with residual, of x + residual, which is written into x."""
    out = torch.empty_like(x)
    r = x if residual is None else residual
    _kernels().rms_norm[(x.shape[0],)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), x.shape[1], eps,
                                       HAS_RESIDUAL=residual is not None, BLOCK=_pow2(x.shape[1]),
                                       **_pdl_options(x.device))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * cols] (gate | up) -> silu(gate) * up, [tokens, cols]."""
    tokens, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(cols))
    _kernels().silu_mul[(tokens, -(-cols // block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                     BLOCK=block, **_pdl_options(gate_up.device))
    return out


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                  largest: float = 0.0) -> torch.Tensor:
    """From q|k|v [tokens, (heads + 2 kv heads) * dim]: the rotated queries [tokens, heads, dim]; rotated keys and
    the values written into the pool [blocks, block size, kv heads, dim] at slots (flat block * size + offset).
    cos, sin: [tokens, 1, dim / 2] fp32, as RotaryEmbedding gives them. largest > 0: a quantized pool's (dim + 4
    wide), each row's numbers over its scale, amax / largest (layers/kv_quant.py)."""
    tokens = qkv.shape[0]
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    q = torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device)
    k_scales, v_scales = _quantized(k_cache)[1], _quantized(v_cache)[1]
    _kernels().rope_store_kv[(tokens, heads + kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, k_scales, v_scales, slots, qkv.stride(0), cos.stride(0), q.stride(0),
        k_cache.stride(1), k_cache.stride(2), HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HALF_PAD=_pow2(dim // 2),
        LARGEST=largest, **_pdl_options(qkv.device))
    return q


@dataclass(frozen=True)
class QuantizedRows:
    """A GGUF matrix kept quantized on the GPU: each row's blocks of 32 weights one after another (the layout
    triton_kernels.weight_tile reads; layers/quantized.py converts from the CPU's interleaved one)."""

    q: torch.Tensor  # [out, in * bits / 8]: uint8 blocks of 4 to 6 bits, or int8 [out, in] of 8
    scales: torch.Tensor  # [out, in / sub], fp16 or fp32
    mins: torch.Tensor | None  # as scales, or None for 0
    zero: int
    sub: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The dense [out, in] matrix in dtype, or the given rows of it (an embedding's lookup)."""
        n, cols = self.shape if rows is None else (rows.numel(), self.shape[1])
        out = torch.empty(n, cols, dtype=dtype, device=self.q.device)
        block_n, block_k = 16, min(256, _pow2(cols))
        _kernels().dequantize[(-(-n // block_n), -(-cols // block_k))](
            self.q, self.scales, self.scales if self.mins is None else self.mins, self.q if rows is None else rows,
            out, n, cols, self.q.stride(0), self.scales.stride(0), out.stride(0), **self.format(),
            HAS_INDEX=rows is not None, BLOCK_N=block_n, BLOCK_K=block_k, **_pdl_options(self.q.device))
        return out

    def format(self) -> dict[str, int | bool]:
        """The kernels' constexprs of this layout."""
        return {"BITS": self.bits, "SUB": self.sub, "ZERO": self.zero, "HAS_MINS": self.mins is not None}


DENSE = {"BITS": 0, "SUB": 1, "ZERO": 0, "HAS_MINS": False}


# A decode step's projections of few rows run as row_matmul, with the op before each fused in: on an H200, cuBLAS
# took ~3.8 us a projection of SmolLM2's shape at one row, and the norms and SwiGLU a launch each beside it. A tiled
# version for up to 16 rows (tl.dot, 128 columns a pass) took 12 us a call: each pass of its loop waited for its
# loads. So a dense matrix takes it for one row; a quantized one for up to QUANTIZED_ROWS, its weights dequantized
# as they are read (beyond, they are dequantized for cuBLAS: vLLM's GGUF path draws the same line at 8 rows).
QUANTIZED_ROWS = 8
_row_matmul = [True]  # the A/B switch: EngineConfig.gpu_row_matmul (Engine._setup)


def use_row_matmul(on: bool) -> None:
    _row_matmul[0] = on


def row_matmul_runs(x: torch.Tensor, quantized: bool = False) -> bool:
    """Whether x times a dense (or quantized) weight takes row_matmul: one row (up to QUANTIZED_ROWS), on a GPU where
    the kernels run."""
    return _row_matmul[0] and x.shape[0] <= (QUANTIZED_ROWS if quantized else 1) and runs(x)


# Outputs a program computes, and the most columns a pass of its loop reads (of one row: more rows, fewer columns, so
# a program's product stays in registers). Fewer outputs, more programs, more loads in flight at once; a SmolLM2
# projection's 576-1,536 columns in one pass (the sweeps on an H200 and an H100: docs/performance/tuning.md).
# Triton's interpreter runs a program's ops as numpy calls, whatever their size: there a program takes 32 outputs,
# for the same results in an eighth of the programs (the tests' time).
ROW_OUTPUTS = 32 if _INTERPRETING else 4
ROW_COLUMNS = 1024
ROW_WARPS = 4

_PROLOGUES = {"none": 0, "norm": 1, "add_norm": 2, "silu_mul": 3, "gelu_mul": 4}


def row_matmul(x: torch.Tensor, weight: torch.Tensor | QuantizedRows, bias: torch.Tensor | None = None,
               prologue: str = "none", norm: torch.Tensor | None = None, eps: float = 0.0,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T + bias, the stream x + residual where prologue is add_norm, else None), for x of a few
    rows [rows, cols] (the activations' prologues: [rows, 2 * cols], gate | up). triton_kernels.row_matmul says what
    each prologue computes."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = x.shape[0]
    if isinstance(weight, QuantizedRows):
        w, scales, mins, layout = weight.q, weight.scales, weight.mins, weight.format()
    else:
        w, scales, mins, layout = weight, weight, None, DENSE
    n_out = weight.shape[0]
    cols = x.shape[1] // 2 if prologue in ("silu_mul", "gelu_mul") else x.shape[1]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    stream = torch.empty(rows, cols, dtype=x.dtype, device=x.device) if prologue == "add_norm" else None
    r = x if residual is None else residual
    block_m = _pow2(rows)
    _kernels().row_matmul[(-(-n_out // ROW_OUTPUTS),)](
        x, r, w if norm is None else norm, w, scales, scales if mins is None else mins, w if bias is None else bias,
        out, x if stream is None else stream, rows, cols, n_out, eps, x.stride(0), r.stride(0),
        0 if stream is None else stream.stride(0), out.stride(0), w.stride(0), scales.stride(0),
        PROLOGUE=_PROLOGUES[prologue], HAS_BIAS=bias is not None, **layout,
        BLOCK_M=block_m, BLOCK_N=ROW_OUTPUTS, BLOCK_K=min(_pow2(cols), ROW_COLUMNS // block_m), num_warps=ROW_WARPS,
        **_pdl_options(x.device))
    return out, stream
