"""Dequantizes a GGUF file's tensors into an HF-named state dict (float32 torch tensors).

GGUF quirks handled here: shapes are listed [in, out] (arrays come out (out, in)), and llama-architecture
files store Q/K projections permuted for llama.cpp's interleaved rotary layout, which we undo.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors kvpilot does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if not match or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation (rotary pairs interleaved -> split halves), per head."""
    out_dim = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, out_dim // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(out_dim, *rest))


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the "
                             f"gguf package cannot dequantize") from exc
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is truncated or corrupt ({exc})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def load_gguf_state_dict(reader: Any, path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of every tensor kvpilot uses; Q/K unpermuted for llama/mistral GGUFs."""
    path = Path(path)
    permuted = config.family in ("llama", "mistral")
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = _dequantize(tensor, path)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            array = _unpermute(array, config.num_attention_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            array = _unpermute(array, config.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(array, copy=True))  # own, writable memory
    return state
