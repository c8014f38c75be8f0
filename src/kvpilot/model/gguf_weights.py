"""Reads a GGUF file's tensors into an HF-named state dict: dequantized to float32 torch tensors, or, for the
linear layers' matrices of a packed format (Q8_0 / Q4_0 / Q4_1, Q5_0 / Q5_1, Q4_K / Q5_K / Q6_K, IQ4_NL / IQ4_XS /
MXFP4: quant/formats.py), kept in their blocks (kvpilot.model.quant.PackedWeight).

GGUF quirks handled here: shapes are listed [in, out] (arrays come out (out, in)), and llama-architecture
files store Q/K projections permuted for llama.cpp's interleaved rotary layout, which we undo; Gemma files
store their norm weights with the 1 of Gemma's (1 + weight) added, which we take off; gpt-oss files name the
norm before the experts post_attention_norm and keep the sinks as attn_sinks.weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q/k/v in one tensor (and its ffn_up holds gate and up)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (moe_decoder.py stacks these): the router [E, H], every expert's matrices in one tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
}
# older Mixtral GGUFs: one tensor per expert, blk.N.ffn_{gate,up,down}.E.weight
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# Gemma 2/3: a norm before and after each sub-block; llama.cpp's "ffn_norm" is the pre-feedforward one
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# families whose norms scale by (1 + weight): llama.cpp's converter stores the weight with the 1 added
_GEMMA_FAMILIES = frozenset({"gemma2", "gemma3_text"})
# gpt-oss: llama.cpp's post_attention_norm is the norm before the experts (HF's post_attention_layernorm), and
# attn_sinks.weight the layer's sink logits (HF's self_attn.sinks, a parameter of its own: no .weight)
_GPT_OSS_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                        "attn_sinks": "self_attn.sinks"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, family: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of a `family` model, or None for tensors kvpilot does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if family in _GEMMA_FAMILIES else _GPT_OSS_LAYER_NAMES if family == "gpt_oss" \
        else _LAYER_NAMES
    if (expert := _EXPERT_RE.match(gguf_name)) is not None:
        layer, part, index = expert.groups()
        return f"model.layers.{layer}.mlp.experts.{index}.{part}_proj.weight"
    match = _LAYER_RE.match(gguf_name)
    if not match or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    if names[part] == "self_attn.sinks":
        return f"model.layers.{layer}.self_attn.sinks"
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unshift_norm(array: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """A Gemma norm weight as the HF checkpoint holds it (zero-centred): llama.cpp's stored one minus 1 (exact
    in float32 for stored values in [0.5, 2])."""
    if config.family in _GEMMA_FAMILIES and name.endswith("norm.weight"):
        return array - np.float32(1.0)
    return array


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation (rotary pairs interleaved -> split halves), per head."""
    out_dim = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, out_dim // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(out_dim, *rest))


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """The tensor's float32 values: a matrix of a packed format by the quant kernel when it is loaded (the same
    values bit for bit, tests/model/test_quant_kernels.py, ~10x faster: the embedding table), else the gguf
    package's."""
    from gguf.quants import dequantize

    from kvpilot.model.quant.formats import SUPPORTED_NAMES, packed_format
    from kvpilot.model.quant.kernel import best_isa, loaded_quant_kernel
    from kvpilot.model.quant.packed import PackedWeight

    fmt = packed_format(tensor.tensor_type.name)
    try:
        if fmt is not None and len(tensor.shape) == 2 and loaded_quant_kernel() is not None:
            raw = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[-1]), -1)
            return PackedWeight.from_blocks(raw, fmt).dequantize(torch.float32, best_isa()).numpy()
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the "
                             "gguf package cannot dequantize; kvpilot reads F32, F16, BF16, the legacy "
                             f"(Q4_0 ... Q8_0), K- and IQ-quant types, and keeps {SUPPORTED_NAMES} packed on CPU"
                             ) from exc
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is truncated or corrupt ({exc})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def _unpermute_qk(array: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (rows are whole: it applies to block bytes as well)."""
    if config.family not in ("llama", "mistral", "mixtral"):
        return array
    if name.endswith("self_attn.q_proj.weight"):
        return _unpermute(array, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return _unpermute(array, config.num_key_value_heads)
    return array


def is_linear_weight(hf_name: str) -> bool:
    """Whether the HF-named tensor is a matrix the model multiplies by (a projection, experts, the output layer)."""
    return hf_name.endswith(("_proj.weight", "_exps.weight")) or hf_name in ("lm_head.weight",
                                                                            "model.embed_tokens.weight")


def is_expert_weight(hf_name: str) -> bool:
    """Whether the HF-named tensor holds routed experts' matrices (stacked, or one expert's)."""
    return ".mlp.experts." in hf_name


def linear_tensor_types(reader: Any) -> dict[str, str]:
    """HF name -> GGUF type name of every linear weight (see is_linear_weight) the file holds."""
    types = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is not None and is_linear_weight(name):
            types[name] = tensor.tensor_type.name
    return types


def load_gguf_tensors(reader: Any, path: str | Path, config: ModelConfig, packed_names: frozenset[str],
                      take: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(dense, packed): tensors named in `packed_names` come back as PackedWeight (their GGUF blocks, Q/K
    rows unpermuted) or, for routed experts, as quant.packed_experts.ExpertBlocks (views of the file's blocks, copied
    by the layer that takes them), every other tensor kvpilot uses dequantized to float32. The embedding table is
    always dense as well (token lookup), and packed too when asked (a tied output layer). `take` (a
    tensor-parallel rank's ShardPlan.take) keeps the rank's part of each dense tensor as it is read."""
    from kvpilot.model.quant.formats import packed_format
    from kvpilot.model.quant.packed import PackedWeight
    from kvpilot.model.quant.packed_experts import ExpertBlocks

    path = Path(path)
    dense: dict[str, torch.Tensor] = {}
    packed: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config.family)
        if name is None:
            continue
        if name in packed_names:
            fmt = packed_format(tensor.tensor_type.name)
            if fmt is None:
                raise ModelLoadError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                                     "the packed kernels do not support")
            if is_expert_weight(name):  # [E, rows, cols] stacked (GGUF lists it [cols, rows, E]) or one expert's
                row_bytes = int(tensor.shape[0]) // fmt.block_values * fmt.block_bytes
                experts = int(tensor.shape[-1]) if len(tensor.shape) == 3 else 1
                packed[name] = ExpertBlocks.stacked(np.asarray(tensor.data, dtype=np.uint8).reshape(-1, row_bytes),
                                                    fmt, experts)
                continue
            raw = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[-1]), -1)
            packed[name] = PackedWeight.from_blocks(_unpermute_qk(raw, name, config), fmt)
            if name != "model.embed_tokens.weight":
                continue
        array = _unshift_norm(_unpermute_qk(_dequantize(tensor, path), name, config), name, config)
        tensor = torch.from_numpy(np.array(array, copy=True))  # own, writable memory
        # a rank's part is taken after unpermuting: its heads are whole heads of the HF layout
        dense[name] = tensor if take is None else take(name, tensor)
    return dense, packed
