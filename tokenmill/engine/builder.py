"""What an engine is made of, built from its config: the model (loaded here unless given), the KV cache and the
context it can hold, the scheduler, the runner and its CUDA graphs, the grammar compiler, the sampler and the
speculative proposer (a draft model with its own KV pool)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import backend, kernels
from tokenmill.cache.kv_cache import AttentionPaths, KVCache, KVSpec, PagedKVCache
from tokenmill.cache.sizing import build_kv_cache, prefill_on
from tokenmill.config import EngineConfig
from tokenmill.engine.draft import DraftModelProposer
from tokenmill.engine.graphs import DecodeGraphs
from tokenmill.engine.lora import LoRAManager
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.spec import NgramProposer, Proposer, SuffixCacheProposer
from tokenmill.engine.tensor_parallel import TensorParallel, kv_spec, start_rank0
from tokenmill.errors import ConfigError
from tokenmill.kernels import gpu
from tokenmill.loader import LoadedModel, load_model
from tokenmill.loader.chat_template import ChatTemplate
from tokenmill.loader.lora import load_adapter
from tokenmill.models.config import attention_crossover
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.parallel.collectives import agree_min
from tokenmill.structured.backend import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    loaded: LoadedModel
    kv_cache: KVCache
    max_model_len: int  # the context served: the model's, or what the KV memory holds
    scheduler: Scheduler
    runner: ModelRunner
    grammars: GrammarCompiler  # read by API threads (compile) and by the sampler (masks)
    sampler: Sampler
    proposer: Proposer | None
    tensor_parallel: TensorParallel | None  # the worker ranks, with --tensor-parallel-size > 1
    lora: LoRAManager | None  # the adapters' slots, with --enable-lora or --lora


def build(config: EngineConfig, loaded: LoadedModel | None) -> EngineParts:
    """On the engine thread: OpenMP runs matmuls markedly slower in a thread other than the first one that used it,
    so the thread that computes loads the model."""
    config.check()
    gpu.use_row_matmul(config.gpu_row_matmul)
    gpu.use_pdl(config.gpu_pdl)
    kernels.use_decode_fetch_ahead(config.decode_fetch_ahead)
    tp = None
    if config.tensor_parallel_size > 1:
        if loaded is not None:
            raise ConfigError("--tensor-parallel-size > 1: the engine loads its shards itself (pass no model)")
        tp, loaded = start_rank0(config)
    elif loaded is None:
        if config.threads:
            torch.set_num_threads(config.threads)
        loaded = load(config, config.model, config.max_model_len)
    try:
        return _build(config, loaded, tp)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def _build(config: EngineConfig, loaded: LoadedModel, tp: TensorParallel | None) -> EngineParts:
    if loaded.deterministic != config.deterministic:
        raise ConfigError(f"deterministic={config.deterministic} but the model was loaded with "
                          f"deterministic={loaded.deterministic}")
    tokenizer = loaded.tokenizer
    if config.chat_template:
        loaded.chat_template = ChatTemplate(Path(config.chat_template).read_text(encoding="utf-8"),
                                            tokenizer.bos_token, tokenizer.eos_token)
    tokenizer.token_bytes(0)  # its table is built here, not on the first request that asks for logprobs
    mc = loaded.config
    kv_cache = build_kv_cache(config, kv_spec(loaded, config.kv_cache_dtype), loaded.device, loaded.max_model_len,
                              int if tp is None else agree_min)
    if tp is not None:
        tp.wait_for("ready")
        tp.started()
    max_model_len = context_that_fits(config, loaded.max_model_len, kv_cache.capacity_tokens)
    scheduler = Scheduler(config, kv_cache, max_model_len, tokenizer.eos_token_ids, attention_crossover(mc))
    lora = lora_manager(config, loaded)
    graphs = None if lora is not None else decode_graphs(config, loaded, kv_cache, max_model_len)
    runner = ModelRunner(loaded.model, kv_cache, loaded.device, graphs, None if lora is None else lora.slots)
    grammars = GrammarCompiler(tokenizer.to_json(), mc.vocab_size, tokenizer.eos_token_ids)
    sampler = Sampler(tokenizer.eos_token_ids, loaded.device, config.seed, grammars)
    return EngineParts(loaded, kv_cache, max_model_len, scheduler, runner, grammars, sampler,
                       proposer(config, loaded, kv_cache, max_model_len), tp, lora)


def lora_manager(config: EngineConfig, loaded: LoadedModel) -> LoRAManager | None:
    """The adapters' slots beside the model's projections, with --lora's adapters loaded (a mistake in one stops
    the start, saying which)."""
    if not config.lora_enabled:
        return None
    model = loaded.model
    if not isinstance(model, LlamaForCausalLM) or model.model.lora is not None:
        raise ConfigError("LoRA adapters need a model of its own (one a LoRA engine has not adapted already)")
    manager = LoRAManager(model, loaded.config, config.max_loras, config.max_lora_rank, loaded.dtype, loaded.device)
    for name, path in config.lora_adapters():
        manager.load(load_adapter(name, path, loaded.config, config.max_lora_rank))
    if loaded.device.type == "cuda" and not config.enforce_eager:
        log.info("decode steps run op by op: CUDA graphs are not captured with LoRA adapters yet")
    return manager


def load(config: EngineConfig, model: str, max_model_len: int | None, draft: bool = False) -> LoadedModel:
    """draft: the draft model, served the target's context even past its own: its guesses only get worse there,
    and the target checks every one."""
    return load_model(model, config.weight_plan(), max_model_len,
                      past_trained_context=draft or config.allow_long_max_model_len)


def context_that_fits(config: EngineConfig, context: int, kv_tokens: int) -> int:
    """The context served: the model's, or less when the KV memory cannot hold one whole context (otherwise a
    request that leaves out max_tokens, which defaults to the rest of the context, could never run)."""
    if kv_tokens >= context:
        return context
    if config.max_model_len is not None:
        raise ConfigError(f"--max-model-len {context} needs KV memory for {context} tokens; "
                          f"--kv-cache-memory holds {kv_tokens}: raise it or lower --max-model-len")
    log.warning("KV memory holds %d tokens, less than the model's context of %d: serving a context of %d",
                kv_tokens, context, kv_tokens)
    return kv_tokens


def decode_graphs(config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache,
                  max_model_len: int) -> DecodeGraphs | None:
    """CUDA graphs of decode steps, on a CUDA device over a paged pool where the GPU kernels run (they read the
    block tables themselves); none with --enforce-eager."""
    if loaded.device.type != "cuda" or config.enforce_eager or not isinstance(kv_cache, PagedKVCache):
        return None
    if config.tensor_parallel_size > 1:
        log.info("decode steps run op by op: CUDA graphs are not captured across tensor-parallel ranks yet")
        return None
    if not backend.gpu_kernels(loaded.device):
        log.info("decode steps run op by op: CUDA graphs need the Triton kernels (kernels/gpu.py), not here")
        return None
    if loaded.config.num_experts:
        log.info("decode steps run op by op: a mixture of experts routes on the host (layers/moe.py reads how "
                 "many tokens each expert takes), which a CUDA graph cannot hold")
        return None
    return DecodeGraphs(loaded.model, kv_cache, config.max_num_seqs, max_model_len)


def proposer(config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache, max_model_len: int) -> Proposer | None:
    if config.speculative is None:
        return None
    if config.speculative == "draft":
        return draft_proposer(config, loaded, kv_cache, max_model_len)
    if config.speculative == "suffix":
        return SuffixCacheProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def draft_proposer(config: EngineConfig, target: LoadedModel, kv_cache: KVCache,
                   max_model_len: int) -> DraftModelProposer:
    """The draft model, of the target's vocabulary and context, and its own KV pool: as many tokens as the
    target's, at most speculative_max_seqs whole contexts (sequences not speculating give theirs up when
    short), each with room for its guesses."""
    c = config
    assert c.draft_model is not None, "EngineConfig.check() refuses --speculative draft without one"
    draft = load(c, c.draft_model, max_model_len, draft=True)
    if not draft.tokenizer.same_vocabulary(target.tokenizer):
        raise ConfigError(f"--draft-model {c.draft_model}: its vocabulary is not the model's (a draft's tokens "
                          "must mean what the model's do)")
    mc = draft.config
    spec = KVSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, draft.dtype)
    tokens = min(kv_cache.capacity_tokens, c.speculative_max_seqs * max_model_len)
    num_blocks = -(-tokens // c.block_size) + c.speculative_max_seqs * -(-c.num_speculative_tokens // c.block_size)
    cache = PagedKVCache(spec, draft.device, num_blocks, c.block_size,
                         paths=AttentionPaths(prefill_on=prefill_on(c, spec, draft.device)))
    log.info("draft model %s: its KV pool %.2f GiB for %d tokens", draft.path.name,
             num_blocks * c.block_size * spec.bytes_per_token / 2**30, num_blocks * c.block_size)
    return DraftModelProposer(draft, cache, target.tokenizer.vocab_size)
