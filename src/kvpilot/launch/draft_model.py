"""The draft model of speculative_config method "draft_model": loaded with the target's loader and settings,
checked against the target (same vocabulary and tokenizer, else EngineConfigError naming the field), given
its share of the KV budget, and wrapped in the model-side proposer (model/draft_proposer.py).

The KV budget is split so that the draft's cache holds as many blocks as the target's (every request the
target holds fits in the draft too): the draft's share is its bytes per block over both models' bytes per
block. The draft is loaded before the budget is measured, so on CUDA its weights come out of it.
"""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.fit.kv_cache import kv_cache_bytes_per_block
from kvpilot.launch.args import EngineArgs
from kvpilot.launch.tp import rank_config
from kvpilot.model.choices import cuda_graph_sizes
from kvpilot.model.draft_proposer import DraftModelProposer
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.hub import resolve_model
from kvpilot.model.kv_dtype import resolve_kv_cache_dtype
from kvpilot.model.loader import LoadedModel, load_model
from kvpilot.model.runner import ModelRunner, RunnerLimits

logger = logging.getLogger("kvpilot")
FIELD = "speculative_config.model"


def load_draft(args: EngineArgs, config: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
    """The draft named by config.model, on the target's device with the engine's dtype and quantization;
    EngineConfigError naming the field when it cannot be loaded or does not match the target."""
    assert config.model is not None  # SpeculativeConfig: set for method draft_model
    try:
        draft = load_model(resolve_model(config.model, download_dir=args.download_dir), dtype=args.dtype,
                           device=str(target.device), max_model_len=args.max_model_len, seed=args.seed,
                           quantization=args.quantization, prompt_gemm_dtype=args.prompt_gemm_dtype)
    except ModelLoadError as exc:
        raise EngineConfigError(f"{FIELD}: the draft model could not be loaded: {exc}") from exc
    check_draft_matches(target, draft)
    return draft


def check_draft_matches(target: LoadedModel, draft: LoadedModel) -> None:
    """Drafts are token ids the target verifies: the two must number tokens the same way. Refuses a draft
    whose vocabulary size differs, or whose tokenizer (when both have one) maps any token differently."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise EngineConfigError(f"{FIELD}: the draft's vocabulary has {draft.config.vocab_size} tokens, the "
                                f"target's {target.config.vocab_size}: use a draft of the same model family, "
                                f"with the target's tokenizer")
    if target.tokenizer is None or draft.tokenizer is None:
        return  # token ids only (no tokenizer to compare): the vocabulary size is all there is to check
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise EngineConfigError(f"{FIELD}: the draft's tokenizer differs from the target's (same vocabulary "
                                f"size, different tokens): use a draft with the target's tokenizer")


def draft_kv_share(target: LoadedModel, draft: LoadedModel, block_size: int, kv_cache_dtype: str) -> float:
    """The share of the KV budget the draft's cache takes so that both caches hold the same number of blocks."""
    target_bytes = _bytes_per_block(target, block_size, kv_cache_dtype)
    draft_bytes = _bytes_per_block(draft, block_size, kv_cache_dtype)
    return draft_bytes / (target_bytes + draft_bytes)


def _bytes_per_block(loaded: LoadedModel, block_size: int, kv_cache_dtype: str) -> int:
    element_size = torch.tensor([], dtype=resolve_kv_cache_dtype(kv_cache_dtype, loaded.dtype)).element_size()
    return kv_cache_bytes_per_block(rank_config(loaded), block_size, element_size)


def build_draft_proposer(draft: LoadedModel, args: EngineArgs, num_blocks: int, max_model_len: int,
                         max_num_batched_tokens: int) -> DraftModelProposer:
    """The draft's runner (the target's max_num_seqs, num_blocks blocks) in a DraftModelProposer; on CUDA
    without --enforce-eager its decode steps are captured as CUDA graphs at the target's sizes (eager if the
    capture fails)."""
    config = args.speculative
    assert config is not None
    # +drafts: the draft writes K/V for its own drafts past the request's known tokens
    limits = RunnerLimits(max_num_seqs=args.max_num_seqs,
                          max_model_len=max_model_len + config.num_speculative_tokens)
    runner = ModelRunner(draft, num_blocks, args.block_size, resolve_kv_cache_dtype(args.kv_cache_dtype, draft.dtype),
                         limits=limits, attention_backend=args.attention_backend)
    if draft.device.type == "cuda" and not args.enforce_eager and args.compilation.full_decode \
            and runner.attention.name == "triton":
        try:
            runner.capture_decode_graphs(cuda_graph_sizes(args.max_num_seqs, args.cuda_graph_sizes),
                                         max_num_batched_tokens)
        except RuntimeError as exc:
            runner.graphs = None
            logger.warning("the draft model's CUDA graph capture failed, its decodes run eagerly: %s", exc)
    logger.info("speculative decoding: draft model %s (%d KV blocks of its own), up to %d drafts a step",
                draft.name, num_blocks, config.num_speculative_tokens)
    return DraftModelProposer(runner, max_chunk_tokens=max_num_batched_tokens)
