"""Exact weight sizes of a GGUF file, from the gguf package's tensor table (no dequantization)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any


_STACKED_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")
_ONE_EXPERT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor as the file stores it. Invariant: num_elements == num_rows * num_cols for matrices."""

    name: str  # GGUF name, e.g. blk.3.attn_v.weight
    type_name: str  # GGML type name, e.g. Q4_K
    num_elements: int
    num_bytes: int
    num_rows: int  # outputs (1 for a vector)
    num_cols: int  # values a row (GGUF's first dimension)


@dataclass(frozen=True)
class GgufSizes:
    """Tensor bytes and element counts as stored in the file.

    Invariant: num_bytes_embedding and num_bytes_lm_head are parts of num_bytes (lm_head is 0 when
    the output layer is tied to token_embd).
    """

    num_tensors: int
    num_params: int
    num_bytes: int
    num_bytes_embedding: int
    num_bytes_lm_head: int
    tensor_types: dict[str, int]  # GGML type name -> number of tensors
    num_bytes_expert: int = 0  # one routed expert of one layer (its gate, up and down), on average; 0: dense
    tensors: tuple[GgufTensor, ...] = ()  # every tensor, in file order

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.num_bytes / self.num_params


def gguf_sizes(reader: Any) -> GgufSizes:
    """Sizes from an open `gguf.GGUFReader` (see kvpilot.fit.gguf_metadata.open_gguf)."""
    tensors = list(reader.tensors)
    by_name = {t.name: int(t.n_bytes) for t in tensors}
    return GgufSizes(
        num_tensors=len(tensors),
        num_params=sum(int(t.n_elements) for t in tensors),
        num_bytes=sum(by_name.values()),
        num_bytes_embedding=by_name.get("token_embd.weight", 0),
        num_bytes_lm_head=by_name.get("output.weight", 0),
        tensor_types=dict(Counter(t.tensor_type.name for t in tensors)),
        num_bytes_expert=_bytes_per_expert(tensors),
        tensors=tuple(_tensor(t) for t in tensors),
    )


def _tensor(t: Any) -> GgufTensor:
    """GGUF lists a tensor's shape innermost first: [cols, rows, (experts)]."""
    cols = int(t.shape[0]) if len(t.shape) else 1
    elements = int(t.n_elements)
    return GgufTensor(t.name, t.tensor_type.name, elements, int(t.n_bytes), elements // max(cols, 1), cols)


def _bytes_per_expert(tensors: list[Any]) -> int:
    """Bytes of one routed expert of one layer, averaged over the file's experts: llama.cpp stacks a layer's
    experts in blk.N.ffn_{gate,up,down}_exps (the expert count the tensor's last dimension), older Mixtral
    files keep one blk.N.ffn_{gate,up,down}.E tensor per expert."""
    total, experts = 0, 0
    for t in tensors:
        if _STACKED_EXPERTS.match(t.name):
            total += int(t.n_bytes)
            experts += int(t.shape[-1]) if t.name.split(".")[2] == "ffn_gate_exps" else 0
        elif _ONE_EXPERT.match(t.name):
            total += int(t.n_bytes)
            experts += t.name.split(".")[2] == "ffn_gate"
    return round(total / experts) if experts else 0
