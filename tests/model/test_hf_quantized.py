"""Quantized Hugging Face checkpoints written at test time in each format's exact layout, on tiny random Llama and
Qwen3 models: the weights tokenmill dequantizes equal the format's reference dequantization bit for bit (fp32), and
the model's logits and greedy tokens match transformers' on those dequantized weights. GPTQ and AWQ are packed here
by their published layouts (AutoGPTQ's and AutoAWQ's packers), compressed-tensors' formats by the package itself,
block-wise FP8 as Qwen3-FP8 and DeepSeek store it; their references are computed from the integers, not by
tokenmill's code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import hf_configs, our_logits, save_random_hf_model
from safetensors.torch import load_file, save_file
from test_fidelity import our_greedy, reference_greedy
from tolerances import KL_AGAINST_FP32, LOGITS_AGAINST_TRANSFORMERS

from tokenmill.config import WeightPlan
from tokenmill.errors import ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.loader import load_model, weight_bytes
from tokenmill.loader.hf_quant import dequantized, scheme_of
from tokenmill.loader.safetensors import _read
from tokenmill.loader.safetensors import model_config as read_config

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
GROUP = 32
AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble j of a word holds column order_map[j]


def _int32(words: torch.Tensor) -> torch.Tensor:
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_input_dim(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight: [in, out] 4-bit values -> [in / 8, out], row 8r + j at bits 4j of word r."""
    q = q.to(torch.int64).reshape(q.shape[0] // 8, 8, q.shape[1])
    return _int32(sum(q[:, j] << (4 * j) for j in range(8)))


def pack_output_dim(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, out] 4-bit values -> [rows, out / 8], column 8c + order[j] at bits 4j of word c."""
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // 8, 8)
    return _int32(sum(q[:, :, order[j]] << (4 * j) for j in range(8)))


def random_4bit(inp: int, out: int, gen: torch.Generator, lowest_zero: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's and AWQ's parts as numbers: 4-bit values [in, out], each group's zero points and fp16 scales [groups,
    out]."""
    groups = inp // GROUP
    q = torch.randint(0, 16, (inp, out), generator=gen)
    zero = torch.randint(lowest_zero, 16, (groups, out), generator=gen)
    scales = (torch.rand(groups, out, generator=gen) * 0.05 + 0.01).half()
    return q, zero, scales


def gptq(weight: torch.Tensor, gen: torch.Generator, desc_act: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inp = weight.shape
    q, zero, scales = random_4bit(inp, out, gen, lowest_zero=1)  # GPTQ v1 stores zero - 1: none below 1
    g_idx = torch.arange(inp) // GROUP
    if desc_act:
        g_idx = g_idx[torch.randperm(inp, generator=gen)]
    reference = torch.empty(out, inp)
    for i in range(inp):  # the published formula, one input column at a time
        g = int(g_idx[i])
        reference[:, i] = scales[g].float() * (q[i] - zero[g]).float()
    parts = {"qweight": pack_input_dim(q), "qzeros": pack_output_dim(zero - 1), "scales": scales,
             "g_idx": g_idx.to(torch.int32)}
    return parts, reference


def awq(weight: torch.Tensor, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inp = weight.shape
    q, zero, scales = random_4bit(inp, out, gen, lowest_zero=0)
    group = torch.arange(inp) // GROUP
    reference = (scales[group].float() * (q - zero[group]).float()).t().contiguous()
    parts = {"qweight": pack_output_dim(q, AWQ_ORDER_MAP), "qzeros": pack_output_dim(zero, AWQ_ORDER_MAP),
             "scales": scales}
    return parts, reference


def fp8_block(weight: torch.Tensor, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inp = weight.shape
    values = (torch.randn(out, inp, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-out // GROUP), -(-inp // GROUP), generator=gen) * 1e-3
    reference = torch.empty(out, inp)
    for r in range(out):
        for c in range(0, inp, GROUP):
            reference[r, c:c + GROUP] = values[r, c:c + GROUP].float() * scale_inv[r // GROUP, c // GROUP]
    return {"weight": values, "weight_scale_inv": scale_inv}, reference


def compressed(weight: torch.Tensor, fmt: str, args: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own compressor and its decompression, the reference."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out, inp = weight.shape
    state: dict[str, torch.Tensor] = {"weight": weight}
    if args.strategy == "group":
        grouped = weight.reshape(out, inp // args.group_size, args.group_size)
        if args.symmetric:
            state["weight_scale"] = grouped.abs().amax(-1) / 7
        else:
            low, high = grouped.amin(-1), grouped.amax(-1)
            state["weight_scale"] = (high - low) / 15
            state["weight_zero_point"] = ((-low / state["weight_scale"]).round() - 8).clamp(-8, 7).to(torch.int8)
    elif args.strategy == "block":
        blocks = weight.abs().reshape(out // GROUP, GROUP, inp // GROUP, GROUP)
        state["weight_scale"] = blocks.amax((1, 3)) / 448
    else:
        state["weight_scale"] = weight.abs().amax(1, keepdim=True) / (127 if args.type == "int" else 448)
    compressor = BaseCompressor.load_from_registry(fmt)
    parts = compressor.compress(state, scheme)
    return parts, compressor.decompress(dict(parts), scheme)["weight"].float()


def _ct(fmt: str, **weights: Any) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                  "input_activations": None}}}


def _ct_args(**fields: Any) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**fields)


FORMATS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
             lambda w, g: gptq(w, g, desc_act=False)),
    "gptq-desc-act": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False},
                      lambda w, g: gptq(w, g, desc_act=True)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}, awq),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [GROUP, GROUP]}, fp8_block),
    "ct-w4a16": (_ct("pack-quantized", num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP),
                 lambda w, g: compressed(w, "pack-quantized", _ct_args(num_bits=4, type="int", symmetric=True,
                                                                       strategy="group", group_size=GROUP))),
    "ct-w4a16-asym": (_ct("pack-quantized", num_bits=4, type="int", symmetric=False, strategy="group",
                          group_size=GROUP),
                      lambda w, g: compressed(w, "pack-quantized", _ct_args(
                          num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP))),
    "ct-w8a8": (_ct("int-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"),
                lambda w, g: compressed(w, "int-quantized", _ct_args(num_bits=8, type="int", symmetric=True,
                                                                     strategy="channel"))),
    "ct-fp8-channel": (_ct("float-quantized", num_bits=8, type="float", symmetric=True, strategy="channel"),
                       lambda w, g: compressed(w, "float-quantized", _ct_args(
                           num_bits=8, type="float", symmetric=True, strategy="channel"))),
    "ct-fp8-block": (_ct("float-quantized", num_bits=8, type="float", symmetric=True, strategy="block",
                         block_structure=[GROUP, GROUP]),
                     lambda w, g: compressed(w, "float-quantized", _ct_args(
                         num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[GROUP, GROUP]))),
}


def quantized_folder(dense: Path, folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The dense folder's model with every projection stored in the format; returns each projection's reference
    dequantized weight by module name."""
    quant_config, quantize = FORMATS[name]
    state = load_file(str(dense / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    references = {}
    for key in sorted(state):
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.endswith(PROJECTIONS):
            parts, references[module] = quantize(state.pop(key), gen)
            state.update({f"{module}.{part}": tensor for part, tensor in parts.items()})
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(dense / "tokenizer.json", folder / "tokenizer.json")
    return references


@pytest.fixture(scope="module", params=["llama3-rope", "qwen3"])
def dense(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(folder, hf_configs()[request.param])
    return folder


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_dequantizes_exactly_and_serves_transformers_logits(dense: Path, tmp_path: Path,
                                                                        name: str) -> None:
    folder = tmp_path / "quantized"
    references = quantized_folder(dense, folder, name)
    scheme = scheme_of(json.loads((folder / "config.json").read_text()), folder)
    ours = dict(dequantized(_read(folder, read_config(folder), None), scheme, torch.float32))
    for module, reference in references.items():
        assert torch.equal(ours[f"{module}.weight"], reference), module
    assert not any(k.endswith(("qweight", "scales", "weight_packed", "weight_scale_inv")) for k in ours)

    model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    model.load_state_dict({**model.state_dict(), **{f"{m}.weight": w for m, w in references.items()}})
    # dequantized at load (the kept 4-bit matrices' own bound is the next test's)
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu", quantized=False))
    ids = list(range(3, 200, 7))
    with torch.inference_mode():
        diff = (our_logits(loaded, ids) - model(torch.tensor([ids])).logits[0]).abs().max().item()
    assert diff < LOGITS_AGAINST_TRANSFORMERS, f"{name}: max abs logit diff {diff}"
    assert our_greedy(loaded, ids, 16) == reference_greedy(model, ids, 16)


@pytest.mark.parametrize(("change", "words"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size 48"),
    ({"quant_method": "awq", "version": "gemv"}, "gemv"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    (_ct("marlin-24", num_bits=4, type="int"), "marlin-24"),
    (_ct("pack-quantized", num_bits=2, type="int"), "int with 2 bits"),
    (_ct("pack-quantized", num_bits=4, type="int", strategy="token"), "strategy 'token'"),
])
def test_an_unsupported_quantization_is_refused_at_start_naming_it(dense: Path, tmp_path: Path,
                                                                    change: dict, words: str) -> None:
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = change
    shutil.copytree(dense, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=words.replace("[", r"\[")):
        load_model(str(tmp_path / "m"), WeightPlan(dtype="float32", device="cpu"))


@pytest.mark.parametrize(("name", "part", "words"), [
    ("gptq", "scales", "scales has shape"), ("awq", "qzeros", "qzeros has shape"),
    ("fp8-block", "weight_scale_inv", "weight_scale_inv has shape"), ("ct-w8a8", "weight_scale", "weight_scale has"),
    ("gptq", "g_idx", "g_idx"),
])
def test_a_scale_that_does_not_fit_its_weight_is_refused_naming_the_tensor(dense: Path, tmp_path: Path, name: str,
                                                                           part: str, words: str) -> None:
    folder = tmp_path / "quantized"
    quantized_folder(dense, folder, name)
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in sorted(state) if k.endswith("mlp.up_proj." + part))
    state[key] = state[key][:-1] if part != "g_idx" else state[key] + 1000
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=key.removesuffix("." + part)) as raised:
        load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    assert words in str(raised.value)


def test_a_missing_part_is_named(dense: Path, tmp_path: Path) -> None:
    folder = tmp_path / "quantized"
    quantized_folder(dense, folder, "awq")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"lacks model\.layers\.1\.mlp\.down_proj\.scales"):
        load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))


# Whether each format's matrices are kept in the kernels' 4-bit (W8A8's: one-byte) layout: exactly where that holds
# their values (act order scatters a group along the input; fp32 scales and a zero point: scale * q + min would
# round twice).
KEPT = {"gptq": True, "gptq-desc-act": False, "awq": True, "ct-w4a16": True, "ct-w4a16-asym": False,
        "fp8-block": False, "ct-w8a8": True, "ct-fp8-channel": False}


@pytest.mark.parametrize("name", list(KEPT))
def test_4_bit_matrices_are_kept_in_the_kernels_layout_where_that_is_exact(dense: Path, tmp_path: Path,
                                                                           name: str) -> None:
    folder = tmp_path / "quantized"
    references = quantized_folder(dense, folder, name)
    scheme = scheme_of(json.loads((folder / "config.json").read_text()), folder)
    ours = dict(dequantized(_read(folder, read_config(folder), None), scheme, torch.float32, keep_quantized=True))
    for module, reference in references.items():
        weight = ours[f"{module}.weight"]
        assert isinstance(weight, QuantizedWeight) == KEPT[name], module
        values = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        assert torch.equal(values, reference), module

    kept = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    plain = load_model(str(folder), WeightPlan(dtype="float32", device="cpu", quantized=False))
    assert (weight_bytes(kept.model)[0] > 0) == KEPT[name] and weight_bytes(plain.model)[0] == 0
    ids = list(range(3, 200, 7))
    with torch.inference_mode():
        ours_log = torch.log_softmax(our_logits(kept, ids).double(), -1)
        plain_log = torch.log_softmax(our_logits(plain, ids).double(), -1)
    kl = (plain_log.exp() * (plain_log - ours_log)).sum(-1)
    kl_mean, kl_max = KL_AGAINST_FP32["fp32-quantized"]  # the kernels round each activation row to 8 bits a block
    assert kl.mean() < kl_mean and kl.max() < kl_max, f"{name}: KL mean {kl.mean():.2e}, max {kl.max():.2e}"
