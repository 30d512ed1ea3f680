"""Loading untrusted or unsupported model files: clear errors, fast; quantized weights as their blocks say."""

from __future__ import annotations

import json
import logging
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader
from helpers import (
    generate,
    hf_configs,
    our_logits,
    save_random_hf_model,
    tiny_metadata,
    tiny_tensors,
    write_gguf,
    write_tiny_gguf,
)
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch_file
from safetensors.torch import save_file

from tokenmill import kernels
from tokenmill.backend import resolve_device
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.engine import Engine
from tokenmill.errors import ConfigError, ModelFormatError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.loader import load_model
from tokenmill.loader import safetensors as st_loader
from tokenmill.loader.gguf import GGUFFile
from tokenmill.loader.gguf_blocks import QUANTIZED_TYPES
from tokenmill.models.registry import build_model
from tokenmill.sampling import SamplingParams


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="mamba")
    with pytest.raises(ModelFormatError, match="^unsupported architecture 'mamba' in x.gguf; supported: llama, "
                                               "qwen2, qwen3, gemma3, qwen3moe, olmoe, granitemoe$"):
        load_model(str(path), WeightPlan(device="cpu"))


def test_unsupported_quant_type_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", qtype=GGMLQuantizationType.TQ2_0)
    with pytest.raises(ModelFormatError, match="^x.gguf: tensor blk.0.ffn_down.weight has quantization type TQ2_0, "
                                               "which tokenmill does not load; supported: BF16, F16, F32, Q2_K, "
                                               "Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0$"):
        load_model(str(path), WeightPlan(device="cpu"))


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelFormatError):
        load_model(str(path), WeightPlan(device="cpu"))


QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quantized_weights_load_to_the_values_their_blocks_hold(qtype: str, tmp_path: Path) -> None:
    """A quantized file, dequantized at load (prepacked where the CPU allows), computes the logits of its F32 twin:
    every weight took the values its blocks decode to, in every projection, the embedding and the head. Kept
    quantized (the default on CPU), every matrix the kernels run holds those same values; so does a BF16 file's,
    kept in bf16 for them."""
    quant_type = GGMLQuantizationType[qtype]
    quant_path = write_tiny_gguf(tmp_path / "q.gguf", qtype=quant_type, hidden=256)
    matrices = [t for t in GGUFReader(quant_path).tensors if len(t.shape) == 2]
    assert len(matrices) == 15 and all(t.tensor_type == quant_type for t in matrices)
    quant = load_model(str(quant_path), WeightPlan(dtype="float32", device="cpu", quantized=False))
    twin_path = write_tiny_gguf(tmp_path / "twin.gguf", qtype=quant_type, hidden=256, dequantized=True)
    twin = load_model(str(twin_path), WeightPlan(dtype="float32", device="cpu"))
    ids = list(range(3, 250, 9))
    ours, reference = our_logits(quant, ids), our_logits(twin, ids)
    assert (ours - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()

    kept = load_model(str(quant_path), WeightPlan(dtype="float32", device="cpu")).model
    plain = dict(load_model(str(twin_path), WeightPlan(dtype="float32", device="cpu", prepack=False,
                                                       bf16_kernels=False)).model.named_modules())
    quantized = {name: m for name, m in kept.named_modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)}
    runs_kernels = kernels.load() and kernels.has_vector_kernels()
    bf16 = quant_type == GGMLQuantizationType.BF16 and runs_kernels
    if quant_type not in QUANTIZED_TYPES and not bf16 or not runs_kernels:
        assert not quantized
        return
    if bf16:  # bf16 values: the matrices in the kernels' 16-bit layout, the lookup reading the tied head's rows
        assert {m.weight.bits for m in quantized.values()} == {16}, sorted(quantized)
    # q/k/v and gate/up of one layer each stacked in one matrix, o and down, the embeddings and the tied head
    assert len(quantized) == 2 * 4 + 2, sorted(quantized)
    assert quantized["lm_head"].weight is quantized["model.embed_tokens"].weight  # tied: one copy in memory
    for name, module in quantized.items():
        expected = plain["model.embed_tokens" if name == "lm_head" else name].weight
        assert torch.equal(module.weight.dequantize(), expected), name


def _field_value_offset(path: Path, key: str) -> int:
    """Where the value of metadata `key` starts (after its key string and its type)."""
    field = GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _craft(tmp_path: Path, edit) -> Path:
    data = bytearray(write_tiny_gguf(tmp_path / "good.gguf").read_bytes())
    path = tmp_path / "crafted.gguf"
    edit(data, tmp_path / "good.gguf")
    path.write_bytes(bytes(data))
    return path


def _put_u64(data: bytearray, offset: int, value: int) -> None:
    data[offset:offset + 8] = struct.pack("<Q", value)


def _rename(data: bytearray, old: bytes, new: bytes) -> None:
    """Overwrite the first occurrence of old in the file with new, of the same length."""
    at = data.find(old)
    data[at:at + len(old)] = new


def _tensor_offset_field(path: Path) -> int:
    tensor = GGUFReader(path).tensors[-1]
    return tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape) + 4


PAST_END = r"a read of \d+ x \w+ at byte \d+ runs past the end of the file"
# name: (the edit, the error our reader's checks raise: the stock reader fails on these too, but elsewhere)
CRAFTED_GGUFS = {
    "truncated in the header": (lambda d, p: d.__delitem__(slice(20, None)), PAST_END),
    "truncated in the metadata": (
        lambda d, p: d.__delitem__(slice(_field_value_offset(p, "tokenizer.ggml.tokens") + 100, None)),
        r"array item count 259 at byte \d+ cannot fit in the 88 bytes left"),
    "truncated in the tensor data": (lambda d, p: d.__delitem__(slice(len(d) - 64, None)), PAST_END),
    "absurd string length": (lambda d, p: _put_u64(d, _field_value_offset(p, "general.architecture"), 2**62),
                             r"a read of 4611686018427387904 x uint8 at byte \d+ runs past the end"),
    "absurd string length in an array": (
        lambda d, p: _put_u64(d, _field_value_offset(p, "tokenizer.ggml.tokens") + 12, 2**62),
        r"a string of 4611686018427387904 bytes at byte \d+ runs past the end of the file"),
    "absurd array length": (lambda d, p: _put_u64(d, _field_value_offset(p, "tokenizer.ggml.tokens") + 4, 2**60),
                            r"array item count 1152921504606846976 at byte \d+ cannot fit"),
    "absurd metadata count": (lambda d, p: _put_u64(d, 16, 2**60),
                              r"metadata key count 1152921504606846976 at byte 24 cannot fit"),
    "absurd tensor count": (lambda d, p: _put_u64(d, 8, 2**60), r"tensor count 1152921504606846976 at byte \d+ "
                                                                r"cannot fit"),
    "tensor data past the end": (lambda d, p: _put_u64(d, _tensor_offset_field(p), 2**40), PAST_END),
    "no architecture": (lambda d, p: _rename(d, b"general.architecture", b"general.architecturX"),
                        r"^unsupported architecture '' in crafted.gguf"),
    "no embedding": (lambda d, p: _rename(d, b"token_embd.weight", b"token_embX.weight"),
                     r"^crafted.gguf has no token_embd.weight tensor$"),
    "more layers than tensors": (lambda d, p: d.__setitem__(
        slice(_field_value_offset(p, "llama.block_count"), _field_value_offset(p, "llama.block_count") + 4),
        struct.pack("<I", 100_000)), r"the metadata describes a model of \d+ weights, the file holds 139776"),
}


def test_metadata_reads_as_the_stock_reader_reads_it(tmp_path: Path) -> None:
    """Our reader's fast paths for arrays (one view for scalars, a slice per string) give gguf's own values: the
    vocabulary, the token types and nested arrays."""
    path = write_tiny_gguf(tmp_path / "t.gguf", metadata={"nested": [[1, 2], [3]]})
    stock = {name: field.contents() for name, field in GGUFReader(path).fields.items() if not name.startswith("GGUF.")}
    ours = GGUFFile(path).metadata
    assert ours == stock and ours["llama.nested"] == [1, 2, 3]  # gguf flattens nested arrays
    assert len(ours["tokenizer.ggml.tokens"]) == 259 and ours["tokenizer.ggml.tokens"][256] == "<|endoftext|>"


@pytest.mark.parametrize("case", CRAFTED_GGUFS.values(), ids=CRAFTED_GGUFS.keys())
def test_crafted_gguf_is_refused_fast_by_our_checks(case, tmp_path: Path) -> None:
    edit, reason = case
    path = _craft(tmp_path, edit)
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match="crafted.gguf") as refused:
        load_model(str(path), WeightPlan(dtype="float32", device="cpu"))
    assert time.perf_counter() - started < 1.0
    assert re.search(reason, str(refused.value)), str(refused.value)


# A count in the file, and the least bytes each of its items takes: (where the count is, where its items start)
COUNT_BOUNDS = {
    "metadata key": (lambda p: 16, lambda p: 24, 13),
    "tensor": (lambda p: 8, lambda p: GGUFReader(p).tensors[0].field.offset, 24),
    "int32 array item": (lambda p: _field_value_offset(p, "tokenizer.ggml.token_type") + 4,
                         lambda p: _field_value_offset(p, "tokenizer.ggml.token_type") + 12, 4),
    "string array item": (lambda p: _field_value_offset(p, "tokenizer.ggml.tokens") + 4,
                          lambda p: _field_value_offset(p, "tokenizer.ggml.tokens") + 12, 8),
    "nested array item": (lambda p: _field_value_offset(p, "llama.nested") + 4,
                          lambda p: _field_value_offset(p, "llama.nested") + 12, 12),
}


@pytest.mark.parametrize("what", COUNT_BOUNDS)
def test_a_count_is_refused_exactly_when_its_items_cannot_fit(what: str, tmp_path: Path) -> None:
    """The checks refuse a count at once only where even the smallest items could not fit in the bytes left: one
    item fewer passes them (and fails later, reading what is not there)."""
    count_at, items_at, least = COUNT_BOUNDS[what]
    good = write_tiny_gguf(tmp_path / "good.gguf", metadata={"nested": [[1, 2], [3]]})
    data = bytearray(good.read_bytes())
    data += bytes(-(len(data) - items_at(good)) % least)  # the bytes left hold a whole number of smallest items
    fits = (len(data) - items_at(good)) // least
    label = what.split(" ", 1)[1] if "array" in what else what
    for count, refused in ((fits, False), (fits + 1, True)):
        _put_u64(data, count_at(good), count)
        (tmp_path / "crafted.gguf").write_bytes(data)
        with pytest.raises(ModelFormatError) as error:
            load_model(str(tmp_path / "crafted.gguf"), WeightPlan(dtype="float32", device="cpu"))
        assert bool(re.search(f"{label} count {count} at byte {items_at(good)} cannot fit", str(error.value))) \
            == refused, str(error.value)


# llama.cpp's tensor names for Hugging Face's (the GGUF spec; written out here, not taken from the loader)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q and k rows (rotate-half pairs become adjacent)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_from_hf(folder: Path, path: Path, rope_freqs: tuple[float, ...] | None) -> Path:
    """Convert a Hugging Face folder as llama.cpp's converter would (for the families tokenmill serves)."""
    cfg = json.loads((folder / "config.json").read_text())
    arch, heads, kv_heads = cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = {} if rope_freqs is None else {"rope_freqs.weight": np.array(rope_freqs, np.float32)}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        gguf_name = f"blk.{layer[1]}.{GGUF_BLOCK_NAMES[layer[2]]}" if layer else GGUF_NAMES[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _llama_cpp_permute(value, heads if "q_proj" in name else kv_heads)
        tensors[gguf_name] = value.astype(np.float32)
    rope = cfg.get("rope_parameters") or {}
    metadata = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
                "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
                "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                "attention.key_length": cfg.get("head_dim"), "attention.value_length": cfg.get("head_dim"),
                "rope.freq_base": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"])}
    return write_gguf(path, arch, metadata, tensors)


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2", "qwen3"])
def test_a_gguf_loads_to_the_model_of_the_folder_it_was_converted_from(name: str, tmp_path: Path) -> None:
    """Names, llama's q/k row order, biases, q/k norms, untied heads, rope_freqs and every metadata key."""
    transformers = pytest.importorskip("transformers")  # noqa: F841 - the folder is written by it
    save_random_hf_model(tmp_path, hf_configs()[name])
    folder = load_model(str(tmp_path), WeightPlan(dtype="float32", device="cpu"))
    gguf = load_model(str(gguf_from_hf(tmp_path, tmp_path / "m.gguf", folder.config.rope_freq_factors)),
                      WeightPlan(dtype="float32", device="cpu"))
    if folder.config.rope_freq_factors is not None:  # stored as float32 in the GGUF
        assert gguf.config.rope_freq_factors == pytest.approx(folder.config.rope_freq_factors, rel=1e-6)
        gguf.config.rope_freq_factors = folder.config.rope_freq_factors
    assert gguf.config.rms_norm_eps == pytest.approx(folder.config.rms_norm_eps, rel=1e-6)
    gguf.config.rms_norm_eps = folder.config.rms_norm_eps
    assert gguf.config == folder.config
    ids = list(range(3, 250, 7))
    assert (our_logits(gguf, ids) - our_logits(folder, ids)).abs().max().item() < 1e-5


def test_metadata_a_file_leaves_out_takes_the_llama_cpp_defaults(tmp_path: Path) -> None:
    optional = ("attention.head_count_kv", "attention.key_length", "attention.layer_norm_rms_epsilon",
                "rope.freq_base", "context_length")
    path = write_tiny_gguf(tmp_path / "m.gguf", kv_heads=4, metadata=dict.fromkeys(optional))
    config = load_model(str(path), WeightPlan(dtype="float32", device="cpu")).config
    assert (config.num_kv_heads, config.head_dim, config.rms_norm_eps, config.rope_theta,
            config.max_position_embeddings) == (4, 16, 1e-6, 10000.0, 4096)


def test_metadata_is_the_files_key_values_not_the_readers_header_fields(tmp_path: Path) -> None:
    gguf = GGUFFile(write_tiny_gguf(tmp_path / "m.gguf"))
    assert gguf.architecture == "llama" and gguf.metadata["llama.block_count"] == 2
    assert {key.split(".")[0] for key in gguf.metadata} == {"general", "llama", "tokenizer"}


def test_one_kv_head_loads(tmp_path: Path) -> None:
    loaded = load_model(str(write_tiny_gguf(tmp_path / "mqa.gguf", kv_heads=1)), WeightPlan(dtype="float32",
                                                                                            device="cpu"))
    assert loaded.config.num_kv_heads == 1 and torch.isfinite(our_logits(loaded, [1, 2, 3])).all()


@pytest.mark.parametrize("key,value,expected", [
    ("block_count", None, "block_count is None, not a positive integer"),
    ("block_count", "2", "block_count is '2', not a positive integer"),
    ("block_count", True, "block_count is True, not a positive integer"),
    ("attention.head_count", 0, "attention.head_count is 0, not a positive integer"),
    ("attention.head_count_kv", -2, "attention.head_count_kv is -2, not a positive integer"),
    ("attention.key_length", 0, "attention.key_length is 0, not a positive integer"),
    ("embedding_length", 0, "embedding_length is 0, not a positive integer"),
    ("feed_forward_length", None, "feed_forward_length is None, not a positive integer"),
    ("context_length", 0, "context_length is 0, not a positive integer"),
    ("attention.layer_norm_rms_epsilon", "small", "attention.layer_norm_rms_epsilon is 'small', not a positive number"),
    ("attention.layer_norm_rms_epsilon", 0.0, "attention.layer_norm_rms_epsilon is 0.0, not a positive number"),
    ("rope.freq_base", -1.0, "rope.freq_base is -1.0, not a positive number"),
    ("rope.freq_base", False, "rope.freq_base is False, not a positive number"),
])
def test_metadata_of_the_wrong_kind_is_a_clear_error(key: str, value, expected: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", metadata={key: value})
    with pytest.raises(ModelFormatError, match=f"^m.gguf: metadata llama.{re.escape(expected)}$"):
        load_model(str(path), WeightPlan(dtype="float32", device="cpu"))


def test_tensors_outside_the_forward_pass_are_ignored(tmp_path: Path) -> None:
    extra = {"blk.0.attn_rot_embd": np.zeros(4, np.float32), "token_types.weight": np.zeros((2, 64), np.float32)}
    tensors = {**extra, **tiny_tensors()}
    with_extra = load_model(str(write_gguf(tmp_path / "x.gguf", "llama", tiny_metadata(), tensors)),
                            WeightPlan(dtype="float32", device="cpu"))
    plain = load_model(str(write_tiny_gguf(tmp_path / "p.gguf")), WeightPlan(dtype="float32", device="cpu"))
    assert torch.equal(our_logits(with_extra, [1, 2, 3]), our_logits(plain, [1, 2, 3]))


def test_a_big_endian_file_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "be.gguf", "llama", tiny_metadata(), tiny_tensors(), endianess=GGUFEndian.BIG)
    with pytest.raises(ModelFormatError, match="be.gguf is a big-endian GGUF file; tokenmill loads little-endian"):
        load_model(str(path), WeightPlan(dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random Hugging Face folders: qwen3 (untied head, q/k norms), qwen2 (tied head, q/k/v biases)."""
    pytest.importorskip("transformers")
    folders = {}
    for name in ("qwen3", "qwen2"):
        folders[name] = tmp_path_factory.mktemp(name)
        save_random_hf_model(folders[name], hf_configs()[name])
    return folders


def _edited(folder: Path, dest: Path, edit) -> Path:
    """A copy of folder whose checkpoint is edit(dict of its tensors)."""
    dest.mkdir()
    for file in ("config.json", "tokenizer.json"):
        (dest / file).write_bytes((folder / file).read_bytes())
    save_file(edit(load_torch_file(folder / "model.safetensors")), dest / "model.safetensors")
    return dest


@pytest.mark.parametrize("family,name,message", [
    ("qwen3", "model.norm.weight", '"model.norm.weight"'),
    ("qwen3", "lm_head.weight", '"lm_head.weight"'),
    ("qwen3", "model.layers.1.self_attn.k_proj.weight", "the checkpoint lacks model.layers.1.self_attn.k_proj.weight$"),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", "the checkpoint lacks model.layers.0.self_attn.v_proj.bias$"),
    ("qwen3", "model.layers.0.mlp.*_proj.weight", r'"model.layers.0.mlp.gate_up_proj.weight".*\(gate_up_proj stacks '
                                                  r"gate_proj, up_proj\)$"),
])
def test_a_checkpoint_lacking_a_tensor_is_refused_naming_it(family: str, name: str, message: str,
                                                            hf_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _edited(hf_folders[family], tmp_path / "m", lambda tensors: {
        k: v for k, v in tensors.items() if not re.fullmatch(name.replace(".", r"\.").replace("*", "(gate|up)"), k)})
    with pytest.raises(ModelFormatError, match=message):
        load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))


@pytest.mark.parametrize("name,message", [
    ("model.layers.0.mlp.down_proj.weight", r"size mismatch for model\.layers\.0\.mlp\.down_proj\.weight: copying "
                                            r"a param with shape torch\.Size\(\[64, 127\]\) from checkpoint"),
    ("model.layers.1.self_attn.v_proj.weight", r"^model\.layers\.1\.self_attn\.v_proj\.weight: checkpoint shape "
                                               r"\(64, 63\), model expects \(64, 64\)$"),
])
def test_a_mis_shaped_tensor_is_refused_naming_it(name: str, message: str, hf_folders: dict[str, Path],
                                                  tmp_path: Path) -> None:
    folder = _edited(hf_folders["qwen3"], tmp_path / "m",
                     lambda tensors: {**tensors, name: tensors[name][:, 1:].contiguous()})
    with pytest.raises(ModelFormatError, match=message):
        load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))


def test_a_damaged_folder_is_refused_naming_the_file(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """A truncated safetensors file and a tokenizer.json that is not JSON were tracebacks from their libraries."""
    truncated = _edited(hf_folders["qwen2"], tmp_path / "truncated", lambda tensors: tensors)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match=f"^cannot read {weights}: Error while deserializing header"):
        load_model(str(truncated), WeightPlan(dtype="float32", device="cpu"))
    garbled = _edited(hf_folders["qwen2"], tmp_path / "garbled", lambda tensors: tensors)
    (garbled / "tokenizer.json").write_text("garbage{")
    with pytest.raises(ModelFormatError, match=f"^cannot read {garbled / 'tokenizer.json'}: expected value"):
        load_model(str(garbled), WeightPlan(dtype="float32", device="cpu"))


def test_a_context_past_the_models_is_refused(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """Positions the model was never trained on give noise; vLLM refuses them too."""
    trained = load_model(str(hf_folders["qwen2"]), WeightPlan(dtype="float32",
                                                              device="cpu")).config.max_position_embeddings
    assert load_model(str(hf_folders["qwen2"]), WeightPlan(dtype="float32", device="cpu"),
                      max_model_len=trained).max_model_len \
        == trained
    with pytest.raises(ConfigError, match=f"^--max-model-len {trained + 1}: the model was trained for a context of "
                                          rf"{trained} tokens \(--allow-long-max-model-len serves it anyway\)$"):
        load_model(str(hf_folders["qwen2"]), WeightPlan(dtype="float32", device="cpu"), max_model_len=trained + 1)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ConfigError, match="trained for a context of 512 tokens"):
        load_model(str(gguf), WeightPlan(dtype="float32", device="cpu"), max_model_len=513)


def test_allow_long_max_model_len_serves_past_the_trained_context(tiny_gguf: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """--allow-long-max-model-len: the context asked for is served, past the model's 512 tokens, with a warning (as
    vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, or llama.cpp's -c past training); a prompt longer than 512 runs."""
    with caplog.at_level(logging.WARNING, logger="tokenmill.loader"):
        engine = Engine(EngineConfig(model=str(tiny_gguf), max_model_len=1024, allow_long_max_model_len=True,
                                     dtype="float32", device="cpu"))
        engine.start()
    try:
        assert engine.max_model_len == 1024
        assert "past the 512 it was trained for" in caplog.text
        assert len(generate(engine, [[3 + i % 200 for i in range(700)]], [SamplingParams(max_tokens=4, temperature=0,
                                                                            ignore_eos=True)])[0]) == 4
    finally:
        engine.stop()


def test_a_device_that_is_not_here_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda on a machine without a GPU was a traceback from inside torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^--device cuda: no CUDA GPU is available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="^--device cuda:1: no CUDA GPU is available"):
        resolve_device("cuda:1")
    with pytest.raises(ConfigError, match="^--device gpu: not a device"):
        resolve_device("gpu")
    with pytest.raises(ConfigError, match="^--device meta: tokenmill runs on cpu and cuda"):
        resolve_device("meta")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="^--device cuda:1: this machine has 1 CUDA GPU"):
        resolve_device("cuda:1")


def test_checkpoint_tensors_the_model_has_no_use_for_are_skipped(hf_folders: dict[str, Path], tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """As transformers and vLLM do: rotary inv_freq buffers, a tied model's lm_head.weight, anything unknown."""
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16), "lm_head.weight": torch.ones(256, 64),
             "model.vision_tower.proj.weight": torch.ones(3, 3)}
    folder = _edited(hf_folders["qwen2"], tmp_path / "m", lambda tensors: {**tensors, **extra})
    with caplog.at_level(logging.DEBUG, logger="tokenmill.models.llama"):
        with_extra = load_model(str(folder), WeightPlan(dtype="float32", device="cpu"))
    plain = load_model(str(hf_folders["qwen2"]), WeightPlan(dtype="float32", device="cpu"))
    assert torch.equal(our_logits(with_extra, [1, 2, 3]), our_logits(plain, [1, 2, 3]))
    assert all(any(name in message for message in caplog.messages) for name in extra)


def test_weights_take_the_requested_dtype_and_device_contiguous(hf_folders: dict[str, Path], device: str) -> None:
    """However the checkpoint's tensors come (here float32, matrices transposed in memory), the parameters are the
    compute dtype on the compute device, contiguous, and nothing is left on the meta device."""
    folder = hf_folders["qwen3"]
    config = st_loader.model_config(folder)
    weights = ((name, t.t().contiguous().t() if t.dim() == 2 else t) for name, t in
               st_loader.load_weights(folder, config, torch.float32))
    model = build_model(config, weights, WeightPlan(prepack=False, bf16_kernels=False), torch.bfloat16,
                        torch.device(device), 64)
    params = dict(model.named_parameters())
    assert len(params) == 3 + 2 * 8  # embeddings, norm, head; per layer 4 norms (2 for q/k), 4 matrices (2 fused)
    for name, param in params.items():
        assert (param.dtype, param.device.type, param.is_contiguous()) == (torch.bfloat16, device, True), name
    buffers = dict(model.named_buffers())
    assert buffers.keys() == {"model.rotary.cos", "model.rotary.sin"}
    assert all(b.dtype == torch.float32 and b.device.type == device and b.shape == (64, 16) for b in buffers.values())


def test_a_loaded_model_does_not_change_with_its_file(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """The parameters own their memory: safetensors maps the file, and the model must not follow it."""
    folder = _edited(hf_folders["qwen3"], tmp_path / "m", lambda tensors: tensors)
    loaded = load_model(str(folder), WeightPlan(dtype="float32", device="cpu", prepack=False))
    before = our_logits(loaded, [1, 2, 3])
    with open(folder / "model.safetensors", "r+b") as file:  # every tensor's bytes zeroed in place
        header = 8 + struct.unpack("<Q", file.read(8))[0]
        file.seek(header)
        file.write(bytes((folder / "model.safetensors").stat().st_size - header))
    assert torch.equal(our_logits(loaded, [1, 2, 3]), before)


def test_an_unsupported_model_type_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelFormatError, match=f"^unsupported model_type 'mamba' in {re.escape(str(tmp_path))}; "
                                               "supported: llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe, "
                                               "olmoe, granitemoe$"):
        load_model(str(tmp_path), WeightPlan(device="cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ModelFormatError, match="is a multimodal Gemma 3 checkpoint; tokenmill serves the text models"):
        load_model(str(tmp_path), WeightPlan(device="cpu"))
