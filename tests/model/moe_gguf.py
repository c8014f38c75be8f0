"""Writes a GGUF of a (tiny) HF Qwen3-MoE or Mixtral model as llama.cpp's convert_hf_to_gguf.py lays it out:
Qwen3-MoE as `qwen3moe` (Q/K as HF stores them), Mixtral as `llama` with an expert count (Q/K permuted for
llama.cpp's interleaved rotary); the router as ffn_gate_inp and every expert of a layer in one tensor each
(ffn_gate_exps, ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]), or, with `per_expert`, as older Mixtral files
did (blk.N.ffn_gate.E.weight ...); float32 tensors, or with `types` the matrices quantized to GGUF blocks
(tests/model/kquant_blocks.py); the metadata keys llama.cpp reads for the experts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tests.model.gguf_header import add_decoder_metadata

from tests.model.kquant_blocks import quantize_blocks

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of a llama-architecture Q/K projection."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_metadata(writer: GGUFWriter, config, arch: str) -> None:
    add_decoder_metadata(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(config.num_experts if arch == "qwen3moe" else config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _layer_tensors(name: str, values: np.ndarray, arch: str, config, per_expert: bool):
    """(GGUF name, array) pairs of one HF tensor of a decoder layer."""
    _, _, layer, rest = name.split(".", 3)  # model.layers.<i>.<module>.<kind>
    if rest.startswith("mlp.experts."):
        part = rest.rsplit(".", 1)[-1]
        inter = values.shape[1] // 2 if part == "gate_up_proj" else values.shape[2]
        stacked = {"gate": values[:, :inter], "up": values[:, inter:]} if part == "gate_up_proj" else {"down": values}
        if per_expert:
            return [(f"blk.{layer}.ffn_{kind}.{e}.weight", t[e]) for kind, t in stacked.items() for e in range(len(t))]
        return [(f"blk.{layer}.ffn_{kind}_exps.weight", t) for kind, t in stacked.items()]
    module, _, kind = rest.rpartition(".")
    if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
        values = _permute(values, heads)
    return [(f"blk.{layer}.{_LAYER[module]}.{kind}", values)]


def _add(writer: GGUFWriter, name: str, array: np.ndarray, type_name: str | None) -> None:
    """A tensor as float32, or quantized to `type_name` (matrices and stacked experts: rows of the last axis)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if type_name is None or array.ndim < 2:
        writer.add_tensor(name, array)
        return
    raw = quantize_blocks(array.reshape(-1, array.shape[-1]), type_name)
    writer.add_tensor(name, raw.reshape(*array.shape[:-1], -1), raw_dtype=GGMLQuantizationType[type_name])


def write_moe_gguf(model, path: Path, arch: str, per_expert: bool = False,
                   types: Callable[[str], str | None] | None = None) -> None:
    """`model`: an HF Qwen3MoeForCausalLM ("qwen3moe") or MixtralForCausalLM ("llama"), float32, every layer
    a mixture of experts (llama.cpp has no dense layers in these architectures). `types`: GGUF tensor name -> the
    GGUF type to quantize that matrix to (None: float32); the router stays float32 as llama.cpp keeps it."""
    writer = GGUFWriter(str(path), arch)
    _add_metadata(writer, model.config, arch)
    for hf_name, tensor in model.state_dict().items():
        values = tensor.detach().float().numpy()
        pairs = [(_GLOBAL[hf_name], values)] if hf_name in _GLOBAL else \
            _layer_tensors(hf_name, values, arch, model.config, per_expert)
        for name, array in pairs:
            quantized = types is not None and "ffn_gate_inp" not in name and name != "token_embd.weight"
            _add(writer, name, array, types(name) if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
