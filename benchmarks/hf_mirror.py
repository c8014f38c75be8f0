"""An HF transformers model holding exactly a kvpilot model's weights (fused q/k/v and gate/up split back
into HF's names), so a benchmark runs both on the same weights without writing any file."""

from __future__ import annotations

from typing import Any

import torch

from kvpilot.model.loader import LoadedModel

TIED_OR_BUFFERS = ("lm_head.weight", "rotary_emb.")  # absent from kvpilot's parameters, or not weights


def hf_state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """kvpilot's parameters under HF names (views, no copies)."""
    config = loaded.config
    qkv_sizes = [config.q_size, config.kv_size, config.kv_size]
    state: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.model.named_parameters():
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv_sizes, dim=0)):
                state[hf_name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), tensor.split(config.intermediate_size, dim=0)):
                state[hf_name.replace("gate_up_proj", part)] = piece
        else:
            state[hf_name] = tensor
    return state


def hf_mirror(loaded: LoadedModel, hf_config: dict[str, Any]) -> torch.nn.Module:
    """A transformers model of `hf_config` on loaded.device in loaded.dtype, with loaded's weights copied in.
    ValueError when a weight has no counterpart (the architectures do not match)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "transformers_version")}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.device(loaded.device):
        model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    missing, unexpected = model.load_state_dict(hf_state_dict(loaded), strict=False)
    missing = [m for m in missing if not any(t in m for t in TIED_OR_BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto {hf_config['model_type']}: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.eval()
