"""The GPU kernels built by Triton's own compiler, for GPUs this machine lacks. Triton's interpreter
(test_gpu_kernels.py) checks what the kernels compute, but it runs them as Python: a kernel it accepts may still fail
to compile, or ask for more shared memory than a GPU gives a program, and then a GPU server falls back to torch's
ops (gpu.ready). So each launch kernels/gpu.py makes is compiled here, ahead of time, through Triton's own binder
(the argument specialisation a launch on a GPU gets), for the head shapes of the models tokenmill serves. It
found Gemma 3's 256-wide heads taking 152 KB of shared memory in fp32, past what an RTX 4090 gives (gpu._key_tile).

The builds run in child processes: the test session's conftest put Triton in interpreter mode before importing it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# heads, KV heads, head dim, hidden size, MLP width
SHAPES = {
    "SmolLM2-135M": (9, 3, 64, 576, 1536),
    "TinyLlama-1.1B": (32, 4, 64, 2048, 5632),
    "Gemma-3-270M": (4, 1, 256, 640, 2048),
    "Llama-3-8B": (32, 8, 128, 4096, 14336),
}
# The most shared memory a program gets on sm_86 and sm_89 (RTX 30 and 40 series, L4, A10): 99 KiB, the least of
# the GPUs Triton builds bf16 dots for. An H100 gives 227 KiB.
SHARED_LIMIT = 99 * 1024
GROWING = "a growing context"
QUANTIZED_KV_SHAPES = ("SmolLM2-135M", "Gemma-3-270M")  # a quantized KV pool's kernels too, 64- and 256-wide heads


def _ptxas() -> Path | None:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


DTYPES = ("bfloat16", "float32")
PDL = "bfloat16, launched with PDL"
# (model, kernel, shared memory in bytes, the build's hash, and in its PTX: None without PDL's wait and launch of the
# next kernel, else the kernel parameters whose pointers the global loads before the wait read from)
Build = tuple[str, str, int, str, list[int] | None]
ROW_MATMUL_WEIGHTS = {3, 4, 5}  # row_matmul's w_ptr, scales_ptr, mins_ptr
pytestmark = pytest.mark.slow  # Triton's compiler, three processes of it


@pytest.fixture(scope="module")
def builds() -> dict[str, list[Build]]:
    """Each dtype's builds for sm_90 (H100, H200), and bf16's launched with PDL (gpu.pdl_ready): three child
    processes side by side."""
    if _ptxas() is None:
        pytest.skip("Triton with its CUDA compiler (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = {"bfloat16": ["bfloat16", "plain"], "float32": ["float32", "plain"], PDL: ["bfloat16", "pdl"]}
    children = {name: subprocess.Popen([sys.executable, __file__, "90", *arg], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env) for name, arg in args.items()}
    results = {}
    for name, child in children.items():
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        results[name] = [tuple(build) for build in json.loads(out.splitlines()[-1])]
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_launch_compiles_for_an_h100(builds: dict[str, list[Build]], dtype: str) -> None:
    assert {build[0] for build in builds[dtype]} == {*SHAPES, GROWING}
    assert {build[1] for build in builds[dtype]} == {
        "decode_attention", "combine_splits", "prefill_attention", "rms_norm", "silu_mul", "rope_store_kv",
        "row_matmul", "dequantize"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_kernel_fits_a_consumer_gpus_shared_memory(builds: dict[str, list[Build]], dtype: str) -> None:
    too_big = [build for build in builds[dtype] if build[2] > SHARED_LIMIT]
    assert not too_big, f"shared memory past {SHARED_LIMIT} bytes: {too_big}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_growing_context_compiles_no_new_kernels(builds: dict[str, list[Build]], dtype: str) -> None:
    """Steps op by op (--enforce-eager, prompt chunks) change the tables' width and the key splits as contexts grow:
    as constexprs or specialized ints they compiled 39 decode kernels and 31 combines over 520 keys, a stall each."""
    kernels = {(build[1], build[3]) for build in builds[dtype] if build[0] == GROWING}
    assert len(kernels) <= 3  # decode writing its result, decode writing its splits, and their combine


def test_launched_with_pdl_each_kernel_waits_and_only_row_matmul_reads_weights_before(
        builds: dict[str, list[Build]]) -> None:
    """With programmatic dependent launch a kernel runs while the one before it finishes: each must wait for its
    writes before reading (or writing) anything, and let the next kernel start. row_matmul alone reads before the
    wait, and only its weights, which no kernel writes (traced in the PTX from the parameters to the loads' addresses):
    that read is what PDL overlaps with the kernel before. Plain launches carry no wait."""
    pdl = builds[PDL]
    assert {build[1] for build in pdl} == {build[1] for build in builds["bfloat16"]}
    assert all(build[4] is not None for build in pdl), [build for build in pdl if build[4] is None]
    assert all(build[4] == [] for build in pdl if build[1] != "row_matmul")
    assert all(build[4] and set(build[4]) <= ROW_MATMUL_WEIGHTS for build in pdl if build[1] == "row_matmul")
    assert all(build[4] is None for build in builds["bfloat16"] + builds["float32"])


def _pdl_reads(ptx: str) -> list[int] | None:
    """None unless the PTX waits for the kernel before and launches the next (griddepcontrol), else the pointer
    parameters its global loads before the wait read from: each register is traced to the parameters it was computed
    from, instruction by instruction (the code before the wait runs straight, without branches)."""
    if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
        return None
    derived: dict[str, set[int]] = {}
    reads: set[int] = set()
    for line in ptx[:ptx.index("griddepcontrol.wait")].splitlines():
        code = re.sub(r"^@!?%\w+\s+", "", line.split("//")[0].strip()).rstrip(";")
        opcode, _, operands = code.partition("\t") if "\t" in code else code.partition(" ")
        if not operands or "," not in operands:
            continue
        dst, _, src = operands.partition("}") if operands.lstrip().startswith("{") else operands.partition(",")
        sources = {int(p) for p in re.findall(r"_param_(\d+)", src)}
        sources = sources.union(*(derived.get(r, set()) for r in re.findall(r"%\w+", src)))
        if opcode.startswith("ld.global"):
            reads |= sources  # where it reads; the values it loads point nowhere
        else:
            derived.update(dict.fromkeys(re.findall(r"%\w+", dst), sources))
    pointers = {int(p) for p in re.findall(r"\.param \.u64 \.ptr[^\n]*_param_(\d+)", ptx)}  # not strides, sizes
    return sorted(reads & pointers)


def _compile_launches(arch: int, dtype: torch.dtype, pdl: bool) -> list[Build]:
    """Build (above) of each launch gpu.py's functions make for each model's shapes, compiled for sm_<arch>, with
    programmatic dependent launch or without: the launches go to Triton's compiler instead of a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from tokenmill.kernels import gpu, triton_kernels

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    builds: list[Build] = []

    class Compiling:
        """Stands in for the kernels module: `kernel[grid](*args)` compiles the kernel for those arguments, as a
        build for `model`."""

        model = ""

        def __getattr__(self, name: str) -> object:
            fn = getattr(triton_kernels, name)

            def launch(*args: object, **kwargs: object) -> None:
                bind = create_function_from_signature(fn.signature, fn.params, backend)
                bound, specialization, options = bind(*args, **kwargs)
                options, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization,
                                                                      options)
                kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
                builds.append((self.model, name, kernel.metadata.shared, kernel.hash, _pdl_reads(kernel.asm["ptx"])))

            return type("Launch", (), {"__getitem__": lambda self, grid: launch})()

    compiling = Compiling()
    gpu._kernels = lambda: compiling  # type: ignore[assignment,return-value]

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype)

    def ids(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.long)

    def quantized(rows: int, cols: int, bits: int, mins: bool) -> gpu.QuantizedRows:
        sub = 16 if bits == 6 else 32
        scales = torch.empty(rows, cols // sub, dtype=torch.float32 if mins else torch.float16)
        q = torch.empty(rows, cols * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
        return gpu.QuantizedRows(q, scales, scales if mins else None, 32 if bits == 6 else 0, sub, bits)

    for compiling.model, (heads, kv_heads, dim, hidden, width) in SHAPES.items():
        cache = empty(64, 16, kv_heads, dim)
        gpu.paged_decode_attention(empty(1, heads, dim), cache, cache, ids(1, 64), ids(1) + 1, 0.1)  # split keys
        gpu.paged_decode_attention(empty(256, heads, dim), cache, cache, ids(256, 4), ids(256) + 1, 0.1)  # one
        gpu.paged_prefill_attention(empty(40, heads, dim), cache, cache, ids(2, 8), ids(2), torch.tensor([0, 20, 40]),
                                    ids(2), ids(2), 0.1, window=512)
        gpu.rms_norm(empty(3, hidden), empty(hidden), 1e-6, empty(3, hidden))
        gpu.rms_norm(empty(3, hidden), empty(hidden), 1e-6)
        gpu.silu_mul(empty(3, 2 * width))
        qkv = empty((heads + 2 * kv_heads) * dim, hidden)
        gpu.row_matmul(empty(1, hidden), qkv, None, "add_norm", empty(hidden), 1e-6, empty(1, hidden))
        gpu.row_matmul(empty(1, hidden), qkv, empty(qkv.shape[0]), "norm", empty(hidden), 1e-6)
        gpu.row_matmul(empty(1, 2 * width), empty(hidden, width), None, "silu_mul")
        gpu.row_matmul(empty(1, 2 * width), empty(hidden, width), None, "gelu_mul")
        gpu.row_matmul(empty(1, heads * dim), empty(hidden, heads * dim))
        # GGUF's layouts kept quantized, at 1 to 8 rows: Q4_K (mins) and Q6_K in a layer, Q5_0 and Q8_0 beside them
        gpu.row_matmul(empty(1, hidden), quantized(qkv.shape[0], hidden, 4, True), None, "add_norm", empty(hidden),
                       1e-6, empty(1, hidden))
        gpu.row_matmul(empty(8, 2 * width), quantized(hidden, width, 6, False), None, "silu_mul")
        gpu.row_matmul(empty(3, heads * dim), quantized(hidden, heads * dim, 5, False))
        gpu.row_matmul(empty(2, hidden), quantized(2 * width, hidden, 8, False), None, "norm", empty(hidden), 1e-6)
        quantized(qkv.shape[0], hidden, 4, True).dequantize(dtype)
        quantized(qkv.shape[0], hidden, 8, False).dequantize(dtype, ids(5))
        rope = torch.empty(3, 1, dim // 2)
        gpu.rope_store_kv(empty(3, (heads + 2 * kv_heads) * dim), rope, rope, cache, cache, ids(3), heads, kv_heads)
        if compiling.model in QUANTIZED_KV_SHAPES:  # --kv-cache-dtype int8, fp8_e4m3: each row's numbers and scale
            for kv, largest in ((torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)):
                pool = torch.empty(64, 16, kv_heads, dim + 4, dtype=kv)
                gpu.paged_decode_attention(empty(1, heads, dim), pool, pool, ids(1, 64), ids(1) + 1, 0.1)
                gpu.paged_prefill_attention(empty(40, heads, dim), pool, pool, ids(2, 8), ids(2),
                                            torch.tensor([0, 20, 40]), ids(2), ids(2), 0.1)
                gpu.rope_store_kv(empty(3, (heads + 2 * kv_heads) * dim), rope, rope, pool, pool, ids(3), heads,
                                  kv_heads, largest)
    if pdl:
        return builds  # PDL adds no specialisation: the plain builds check a growing context
    compiling.model = GROWING  # steps op by op: tables as wide as the longest context, which grows
    heads, kv_heads, dim = SHAPES["SmolLM2-135M"][:3]
    cache = empty(64, 16, kv_heads, dim)
    for width in range(1, 520, 37):
        for b in (1, 100):
            gpu.paged_decode_attention(empty(b, heads, dim), cache, cache, ids(b, width), ids(b) + 1, 0.1)
    return builds


if __name__ == "__main__":
    from tokenmill.kernels import gpu

    with gpu._pdl_forced(pdl=sys.argv[3] == "pdl"):
        print(json.dumps(_compile_launches(int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "pdl")))
