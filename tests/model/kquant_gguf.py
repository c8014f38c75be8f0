"""The embedded GGUF requantized to another type mix (Q4_K_M, Q5_K_M, Q4_0, and TABLE_MIX: the table formats beside
5-bit ones, see tensor_type), written as a GGUF with all its metadata: for the K-quant tests and
benchmarks/kquant_decode.py, without llama.cpp.

The mixes follow llama.cpp's published recipes: Q4_K_M stores attn_v and ffn_down as Q6_K in the first and last
eighth of the layers and every third one between ("more bits" layers), Q4_K elsewhere, and the output layer (the
tied embedding here) as Q6_K; Q5_K_M the same with Q5_K. A K-quant needs rows of whole 256-value super-blocks: like
llama.cpp, narrower rows fall back to Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (the embedded model's width 576 is
not one: only its ffn_down, 1536 wide, stays K-quant). Blocks are rounded to nearest (tests/model/kquant_blocks.py):
valid blocks near the weights, not llama.cpp's searched ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from kvpilot.fit.gguf_metadata import open_gguf

from tests.model.kquant_blocks import quantize_blocks

MIXES = ("Q4_K_M", "Q5_K_M", "Q4_0", "TABLE_MIX")
# TABLE_MIX: no llama.cpp recipe; every packed format the other mixes leave out, in one file (fused q/k/v of mixed
# formats): attn_q / attn_k IQ4_NL, attn_v / attn_output Q5_1, ffn_gate / ffn_up MXFP4, ffn_down Q5_K in even layers
# and IQ4_XS in odd ones (its 1536-wide rows are whole super-blocks), the head Q8_0
_TABLE_MIX = {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "Q5_1", "attn_output": "Q5_1", "ffn_gate": "MXFP4",
              "ffn_up": "MXFP4", "ffn_down": "Q5_K"}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def _more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layers: int, cols: int) -> str | None:
    """The GGUF type `mix` stores matrix `name` (cols values a row) as; None: kept as it is."""
    match = _LAYER.match(name)
    if name == "token_embd.weight" or name == "output.weight":
        wanted = "Q6_K" if mix.endswith("_K_M") else "Q8_0"
    elif match is None:
        return None
    elif mix == "Q4_0":
        wanted = "Q4_0"
    elif mix == "TABLE_MIX":
        odd_down = match.group(2) == "ffn_down" and int(match.group(1)) % 2
        wanted = "IQ4_XS" if odd_down else _TABLE_MIX[match.group(2)]
    else:
        base = "Q4_K" if mix == "Q4_K_M" else "Q5_K"
        more = match.group(2) in ("attn_v", "ffn_down") and _more_bits(int(match.group(1)), layers)
        wanted = "Q6_K" if more else base
    return _FALLBACK[wanted] if wanted in _FALLBACK and cols % 256 else wanted


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file's own header fields; the writer sets them
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])


def requantize(source: Path, target: Path, mix: str) -> dict[str, str]:
    """Writes `source` as `mix` to `target` (under a .partial name, renamed when complete); returns the types by
    tensor name."""
    reader = open_gguf(source)  # kvpilot's reader: the vocabulary's arrays in bulk (gguf's own took ~3.4 s)
    layers = int(reader.fields["llama.block_count"].contents())
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, str(reader.fields["general.architecture"].contents()))
    _copy_fields(reader, writer)
    types = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        kind = tensor_type(mix, tensor.name, layers, shape[-1]) if len(shape) == 2 else None
        if kind is None or kind == tensor.tensor_type.name:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type if kind else None)
        else:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
            writer.add_tensor(tensor.name, quantize_blocks(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        types[tensor.name] = kind or tensor.tensor_type.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return types
