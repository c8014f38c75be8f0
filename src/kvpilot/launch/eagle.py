"""The EAGLE head of speculative_config method "eagle" or "eagle3": read from its checkpoint directory (vLLM's
layouts, model/models/eagle.py), checked against the target (hidden size, vocabulary: else EngineConfigError
naming speculative_config.model), wrapped as a one-layer LoadedModel on the target's device and dtype, and run
by the model-side EagleProposer (model/eagle_proposer.py) in a ModelRunner of its own.

For EAGLE-3 the target's model is told which layers' inputs to keep (aux_hidden_layers: the head's
`eagle_aux_hidden_state_layer_ids`, else vLLM's default), and its decode steps run without CUDA graphs (a
graph would not leave them). The head's KV cache takes its share of the budget as a draft model's does
(launch/draft_model.py: as many blocks as the target's).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.launch.args import EngineArgs
from kvpilot.model.config import from_hf_config
from kvpilot.model.eagle_proposer import EagleProposer
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.hf_dir import read_hf_config
from kvpilot.model.hub import resolve_model
from kvpilot.model.kv_dtype import resolve_kv_cache_dtype
from kvpilot.model.loader import LoadedModel, _materialize
from kvpilot.model.models.eagle import EagleHead, EagleLayout, default_aux_layers, load_head_state, read_layout
from kvpilot.model.models.llama import LlamaForCausalLM
from kvpilot.model.runner import ModelRunner, RunnerLimits

logger = logging.getLogger("kvpilot")
FIELD = "speculative_config.model"


def load_eagle(args: EngineArgs, config: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
    """The head named by config.model over `target`; EngineConfigError naming the field when it cannot be read or
    does not fit the target. For EAGLE-3, sets the target's aux_hidden_layers."""
    assert config.model is not None and config.method in ("eagle", "eagle3")
    try:
        path = resolve_model(config.model, download_dir=args.download_dir)
        assert path is not None
        return _load(Path(path), config.method, target)
    except ModelLoadError as exc:
        raise EngineConfigError(f"{FIELD}: the EAGLE head could not be loaded: {exc}") from exc


def _load(path: Path, kind: str, target: LoadedModel) -> LoadedModel:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such directory (an EAGLE head is a directory with config.json and "
                             f"its weights)")
    if target.shard is not None or not isinstance(target.model, LlamaForCausalLM) or (
            kind == "eagle3" and type(target.model).forward is not LlamaForCausalLM.forward):
        raise EngineConfigError(f"{FIELD}: EAGLE heads run over an unsharded target of the Llama decoder's forward "
                                f"(model/models/llama.py), not {type(target.model).__name__}")
    cfg = read_hf_config(path)
    state = load_head_state(path)
    layout = read_layout(kind, state, str(path))
    _check_fits(kind, cfg, layout, target)
    head_cfg = {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                "vocab_size": target.config.vocab_size, "tie_word_embeddings": False}
    head_cfg.pop("quantization_config", None)
    config = from_hf_config(head_cfg, str(path / "config.json"))
    config = dataclasses.replace(config, max_position_embeddings=target.config.max_position_embeddings,
                                 eos_token_ids=target.config.eos_token_ids, name=path.name)
    eagle_cfg = cfg.get("eagle_config") or {}
    with torch.device("meta"):
        head = EagleHead(config, layout, target.model, target.config.max_position_embeddings,
                         norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    head = _materialize(head, target.device).to(target.dtype)
    head.rotary.reset_tables(target.device)
    head.load_weights(state, str(path))
    head.eval()
    if kind == "eagle3":
        num_layers = target.config.num_hidden_layers
        layers = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get(
            "eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers))
        if len(layers) * target.config.hidden_size != layout.fc_in or not all(0 <= i < num_layers for i in layers):
            raise EngineConfigError(f"{FIELD}: the EAGLE-3 head's aux layers {list(layers)} do not fit a target of "
                                    f"{num_layers} layers and fc's input of {layout.fc_in}")
        target.model.aux_hidden_layers = layers
    return LoadedModel(config, head, None, path.name, str(path), "safetensors", target.dtype, target.device)


def _check_fits(kind: str, cfg: dict[str, Any], layout: EagleLayout, target: LoadedModel) -> None:
    """Refuses a head trained for another target: its hidden size and vocabulary must be the target's."""
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    if layout.hidden_size != hidden or cfg.get("hidden_size", hidden) != hidden:
        raise EngineConfigError(f"{FIELD}: the EAGLE head's hidden size is {layout.hidden_size}, the target's "
                                f"{hidden}: use a head trained for this target")
    want = 2 * hidden if kind == "eagle" else 3 * hidden
    if layout.fc_in != want:
        raise EngineConfigError(f"{FIELD}: the head's fc.weight takes {layout.fc_in} inputs, method {kind!r} over "
                                f"this target needs {want} ({'2' if kind == 'eagle' else '3'} x hidden "
                                f"{hidden}): is it an {'EAGLE-3' if kind == 'eagle' else 'EAGLE-1'} head?")
    head_vocab = cfg.get("vocab_size", vocab)
    if head_vocab != vocab:
        raise EngineConfigError(f"{FIELD}: the EAGLE head's vocabulary has {head_vocab} tokens, the target's "
                                f"{vocab}: use a head trained for this target")
    if layout.draft_vocab is not None and layout.draft_vocab > vocab:
        raise EngineConfigError(f"{FIELD}: the EAGLE-3 head's draft vocabulary ({layout.draft_vocab}) is larger "
                                f"than the target's ({vocab})")


def build_eagle_proposer(head: LoadedModel, args: EngineArgs, num_blocks: int, max_model_len: int,
                         max_num_batched_tokens: int) -> EagleProposer:
    """The head's runner (the target's max_num_seqs, num_blocks blocks, eager: its hidden inputs change per
    step) in an EagleProposer."""
    config = args.speculative
    assert config is not None
    limits = RunnerLimits(max_num_seqs=args.max_num_seqs,
                          max_model_len=max_model_len + config.num_speculative_tokens)
    runner = ModelRunner(head, num_blocks, args.block_size, resolve_kv_cache_dtype(args.kv_cache_dtype, head.dtype),
                         limits=limits, attention_backend=args.attention_backend)
    logger.info("speculative decoding: %s head %s (%d KV blocks of its own), up to %d drafts a step (a chain)",
                config.method, head.name, num_blocks, config.num_speculative_tokens)
    return EagleProposer(runner, max_chunk_tokens=max_num_batched_tokens)
