"""What a model's packed layers hold in memory, against the bytes their tensors take in the GGUF file.

The figure the loader reports (LoadedModel.packed_memory, logged at load): a packed-only model holds its blocks
(or their int8 copies) in about the file's bytes, K-quants ~1.03x (a 6-bit sub-scale takes a byte); the hybrid
layout adds dense copies for many-row GEMMs, and the embedding table is dense for token lookups either way.
Packed mixture-of-experts layers (PackedExperts) count with the packed bytes (they never hold a dense copy).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from kvpilot.model.quant.linear import PackedLinear
from kvpilot.model.quant.packed_experts import PackedExperts

logger = logging.getLogger("kvpilot")
MIB = 2 ** 20


@dataclass(frozen=True)
class PackedMemory:
    """file_bytes: the packed tensors' bytes in the file; packed_bytes: the blocks and int8 copies held for them;
    dense_bytes: dense copies kept beside them (hybrid layout); embedding_bytes: the dense lookup table;
    expert_bytes: the part of packed_bytes held for routed experts (0 for a dense model)."""

    file_bytes: int
    packed_bytes: int
    dense_bytes: int
    embedding_bytes: int
    expert_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Packed bytes held per byte of the file's packed tensors."""
        return self.packed_bytes / self.file_bytes if self.file_bytes else 0.0

    def summary(self) -> str:
        dense = f", plus {self.dense_bytes / MIB:.1f} MiB of dense copies for many-row GEMMs" \
            if self.dense_bytes else ""
        experts = f" (experts {self.expert_bytes / MIB:.1f} MiB)" if self.expert_bytes else ""
        return (f"packed weights: {self.packed_bytes / MIB:.1f} MiB{experts} held for {self.file_bytes / MIB:.1f} MiB "
                f"of quantized tensors in the file ({self.ratio:.3f}x){dense}; embedding table "
                f"{self.embedding_bytes / MIB:.1f} MiB dense")


def packed_memory(model: nn.Module, file_bytes: int) -> PackedMemory:
    """The bytes `model`'s PackedLinear modules hold, split into quantized and dense copies."""
    packed = dense = 0
    for module in _packed_linears(model.modules()):
        quantized = sum(p.nbytes for p in module.parts)
        if module.int8_weight is not None:
            quantized += module.int8_weight.nbytes_beside(module.parts[0])
        packed += quantized
        dense += module.nbytes - quantized
    experts = sum(m.nbytes for m in model.modules() if isinstance(m, PackedExperts))
    embed = getattr(model, "embed_tokens", None)
    embedding = 0 if embed is None else embed.weight.numel() * embed.weight.element_size()
    return PackedMemory(file_bytes, packed + experts, dense, embedding, experts)


def _packed_linears(modules: Iterable[nn.Module]) -> list[PackedLinear]:
    return [m for m in modules if isinstance(m, PackedLinear)]


def report_packed_memory(model: nn.Module, reader: Any, names: frozenset[str]) -> PackedMemory:
    """packed_memory of `model`, whose packed layers hold the GGUF `reader`'s tensors with HF names `names` (linear
    weights and experts: their names are the same in every family); logged."""
    from kvpilot.model.gguf_weights import hf_tensor_name

    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if hf_tensor_name(t.name) in names)
    memory = packed_memory(model, file_bytes)
    logger.info("%s", memory.summary())
    return memory


QUANTIZED_TYPE_PREFIXES = ("Q", "IQ", "TQ", "MXFP")  # GGML block types; F32/F16/BF16 hold dense values already


def warn_dequantized(model: nn.Module, reader: Any, path: Any, skipped: frozenset[str] = frozenset()) -> int:
    """Logs a warning naming the cost when a GGUF's quantized tensors were dequantized at load (a type or family
    without a packed kernel, or a GPU): the bytes the model's parameters hold against the file's tensors, those
    kept packed (HF names `skipped`: a family's packed experts) left out of both. Returns the dequantized tensors'
    bytes in the file (0: the file holds none, nothing logged)."""
    from kvpilot.model.gguf_weights import hf_tensor_name

    tensors = [t for t in reader.tensors if hf_tensor_name(t.name) not in skipped]
    quantized = [t for t in tensors if t.tensor_type.name.startswith(QUANTIZED_TYPE_PREFIXES)]
    if not quantized:
        return 0
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    types = ", ".join(sorted({t.tensor_type.name for t in quantized}))
    logger.warning("%s: its %s tensors are dequantized at load: the weights hold %.1f MiB against %.1f MiB in the "
                   "file (%.1fx the memory, and decode reads that much more a token)", path, types, held / MIB,
                   file_bytes / MIB, held / file_bytes if file_bytes else 0.0)
    return sum(int(t.n_bytes) for t in quantized)
