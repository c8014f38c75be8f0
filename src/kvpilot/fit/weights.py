"""Weight storage bytes for a model in a given format (exact for GGUF files)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.model_source import LoadedModel
from kvpilot.fit.weight_formats import weight_format


@dataclass(frozen=True)
class WeightBytes:
    """Bytes by role. Invariant: num_bytes == embedding + lm_head + layers (all >= 0)."""

    format_name: str
    num_bytes_embedding: int
    num_bytes_lm_head: int
    num_bytes_layers: int  # decoder layers (matrices, experts, norms, biases) + final norm
    num_bytes_expert: int  # one routed expert of one layer (0 for dense models)

    @property
    def num_bytes(self) -> int:
        return self.num_bytes_embedding + self.num_bytes_lm_head + self.num_bytes_layers


def weight_bytes(model: LoadedModel, weight_dtype: str = "auto", dtype: str = "auto") -> WeightBytes:
    """`auto` on a GGUF file gives the file's exact tensor bytes; otherwise bits per role x counts."""
    if model.gguf is not None and weight_dtype == "auto":
        g = model.gguf
        layers = g.num_bytes - g.num_bytes_embedding - g.num_bytes_lm_head
        tensor_mix = ", ".join(f"{n} {t}" for t, n in sorted(g.tensor_types.items()))
        return WeightBytes(f"gguf ({tensor_mix})", g.num_bytes_embedding, g.num_bytes_lm_head, layers,
                           g.num_bytes_expert)
    fmt = weight_format(weight_dtype, model.spec, dtype)
    p = model.params
    return WeightBytes(
        format_name=fmt.name,
        num_bytes_embedding=round(p.num_embedding * fmt.bits_embedding / 8),
        num_bytes_lm_head=round(p.num_lm_head * fmt.bits_embedding / 8),
        num_bytes_layers=round(p.num_linear_total * fmt.bits_linear / 8 + p.num_vector * fmt.bits_vector / 8),
        num_bytes_expert=round(p.num_params_per_expert * fmt.bits_linear / 8),
    )
