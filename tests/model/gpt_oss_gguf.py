"""Writes a GGUF of a (tiny) HF gpt-oss model as llama.cpp's convert_hf_to_gguf.py lays it out (`gpt-oss`): the
interleaved gate/up experts split into ffn_gate_exps / ffn_up_exps [E, I, H] (weights transposed to rows of
outputs) with their biases, ffn_down_exps [E, H, I], the router as ffn_gate_inp with its bias, the sinks as
attn_sinks.weight, the norm before the experts as post_attention_norm; the experts float32 or in MXFP4 blocks,
the rest float32; the metadata keys llama.cpp reads (experts, their width, the sliding window, YaRN)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize

from tests.model.gguf_header import add_decoder_metadata
from tests.model.kquant_blocks import quantize_blocks

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def _add_metadata(writer: GGUFWriter, config) -> None:
    add_decoder_metadata(writer, config)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)


def _expert_tensors(layer: str, part: str, values: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """gate_up_proj [E, H, 2I] / down_proj [E, I, H] and their biases -> llama.cpp's tensors."""
    prefix = f"blk.{layer}.ffn"
    if part == "gate_up_proj":
        rows = values.swapaxes(1, 2)  # [E, 2I, H]: a row an output, gate and up alternating
        return [(f"{prefix}_gate_exps.weight", rows[:, 0::2]), (f"{prefix}_up_exps.weight", rows[:, 1::2])]
    if part == "gate_up_proj_bias":
        return [(f"{prefix}_gate_exps.bias", values[:, 0::2]), (f"{prefix}_up_exps.bias", values[:, 1::2])]
    if part == "down_proj":
        return [(f"{prefix}_down_exps.weight", values.swapaxes(1, 2))]
    return [(f"{prefix}_down_exps.bias", values)]


def gguf_tensors(model) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor of `model`, in llama.cpp's layout."""
    out = []
    for hf_name, tensor in model.state_dict().items():
        values = tensor.detach().float().numpy()
        if hf_name in _GLOBAL:
            out.append((_GLOBAL[hf_name], values))
            continue
        _, _, layer, rest = hf_name.split(".", 3)  # model.layers.<i>.<module>.<kind>
        if rest.startswith("mlp.experts."):
            out.extend(_expert_tensors(layer, rest.rsplit(".", 1)[-1], values))
        elif rest == "self_attn.sinks":
            out.append((f"blk.{layer}.attn_sinks.weight", values))
        else:
            module, _, kind = rest.rpartition(".")
            out.append((f"blk.{layer}.{_LAYER[module]}.{kind}", values))
    return out


def round_experts_to_mxfp4(model) -> None:
    """Replaces `model`'s expert matrices with their MXFP4 values (blocks of 32 inputs, as the GGUF holds them),
    so the HF model and the file's dequantized weights are the same numbers."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = param.detach().transpose(1, 2).contiguous().numpy()  # rows of inputs, as the file's
                raw = quantize_blocks(rows.reshape(-1, rows.shape[-1]), "MXFP4")
                back = dequantize(raw, GGMLQuantizationType.MXFP4).reshape(rows.shape)
                param.copy_(torch.from_numpy(np.ascontiguousarray(back)).transpose(1, 2))


def write_gpt_oss_gguf(model, path: Path, experts_type: str | None = None) -> None:
    """`model`: an HF GptOssForCausalLM (float32); `experts_type` "MXFP4" stores the expert matrices as MXFP4
    blocks (round the model's experts first, round_experts_to_mxfp4, to compare it with the file)."""
    writer = GGUFWriter(str(path), "gpt-oss")
    _add_metadata(writer, model.config)
    for name, array in gguf_tensors(model):
        array = np.ascontiguousarray(array, dtype=np.float32)
        if experts_type is None or not name.endswith("_exps.weight"):
            writer.add_tensor(name, array)
            continue
        raw = quantize_blocks(array.reshape(-1, array.shape[-1]), experts_type)
        writer.add_tensor(name, raw.reshape(*array.shape[:-1], -1), raw_dtype=GGMLQuantizationType[experts_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
