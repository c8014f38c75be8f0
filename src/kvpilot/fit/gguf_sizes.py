"""Exact weight sizes of a GGUF file, from the gguf package's tensor table (no dequantization)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


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
    )
