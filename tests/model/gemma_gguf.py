"""Writes a GGUF of a (tiny) HF Gemma 2 / Gemma 3 model the way llama.cpp's convert_hf_to_gguf.py lays it
out: its tensor names, norm weights stored with Gemma's 1 added, Q/K unpermuted (Gemma rotates NEOX-style),
the output layer left out (tied to the embedding), float32 tensors; and the metadata keys llama.cpp reads
(sliding window, soft-caps for Gemma 2, the global RoPE base for Gemma 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from tests.model.gguf_header import add_decoder_metadata

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name of an HF Gemma tensor; None for the tied lm_head."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    if hf_name == "lm_head.weight":
        return None
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.<i>.<module>.weight
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _add_metadata(writer: GGUFWriter, config, arch: str, sliding_window_pattern: int | None) -> None:
    add_decoder_metadata(writer, config)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if arch == "gemma3" else rope["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(sliding_window_pattern)


def write_gemma_gguf(model, path: Path, arch: str, sliding_window_pattern: int | None = None) -> None:
    """`model`: an HF Gemma2ForCausalLM / Gemma3ForCausalLM (float32); `arch`: "gemma2" or "gemma3"."""
    writer = GGUFWriter(str(path), arch)
    _add_metadata(writer, model.config, arch, sliding_window_pattern)
    for hf_name, tensor in model.state_dict().items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        values = tensor.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            values = values + np.float32(1.0)  # the converter's norm shift
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
