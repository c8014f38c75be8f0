"""OneDnnWeight: a bf16 linear weight held in oneDNN's blocked layout on CPU, reordered once at load (the
packed GGUF layers' dense copy, and OneDnnLinear: a dense bf16 model's decoder projections and untied output
layer on CPUs without AVX512_BF16, where layers/bf16_linear.py's kernel does not run; prepack_bf16_linears
picks).

`F.linear` on a plain bf16 weight runs oneDNN too, but reorders the weight into its blocked layout on every
call: an extra pass over every weight byte per GEMM, which dominates at few rows (prepacked weights ran
SmolLM2-135M's projections faster at every row count measured, most at 16-64 rows; docs/benchmark-log.md,
"Figures moved out of the code"). The products are bit for bit F.linear's (the same oneDNN kernels; checked at 1-1,536 rows on those shapes
and the output layer's, and in tests/model/test_onednn_linear.py), except on CPUs with AMX: there oneDNN picks its
blocking of the sums by the call's row count and the weight's layout, so a row's product may differ by a bf16
rounding from F.linear's and from the same row's in a call of another size (F.linear's own results do too).

The blocked tensor is opaque (no strides, no storage): `dense()` gives the plain values back, by a copy.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.fit.fingerprint import cpu_has_amx_bf16
from kvpilot.model.layers.amx_tiles import AmxTileWeight, amx_tiles_kernel
from kvpilot.model.layers.bf16_linear import Bf16Linear, bf16_gemm_kernel
from kvpilot.model.layers.cpu_bf16_ops import get_bf16_ops

logger = logging.getLogger("kvpilot")

# Each kind of copy a CPU model keeps beside its weights for speed (a packed model's dense copy for many-row GEMMs,
# a dense model's float32 copies for prompt GEMMs, its prepacked decode copies on AMX) may take at most this share
# of the memory available at load: a big model on a small machine keeps its weights only (a copy alone could
# exhaust the RAM the KV cache needs).
COPY_MAX_MEMORY_SHARE = 0.25


def copy_fits(copy_bytes: int, available_bytes: int, copy: str) -> bool:
    """Whether a copy of `copy_bytes` fits COPY_MAX_MEMORY_SHARE of `available_bytes`; else logs that `copy` (what
    runs without it, then what it is: "prompt GEMMs in bf16: a float32 copy of the weights") would take too much."""
    if copy_bytes <= COPY_MAX_MEMORY_SHARE * available_bytes:
        return True
    logger.info("%s would take %.1f GiB of the %.1f GiB available", copy, copy_bytes / 2**30, available_bytes / 2**30)
    return False


@lru_cache(maxsize=1)
def onednn_batch_hint() -> int:
    """The row count a weight's oneDNN layout is tuned for (the products are the same GEMM's): without AMX, calls
    of 16-1,536 rows ran as fast with 1 as with 128 or 512; with AMX, a layout for 64 rows ran the embedded model's
    projections faster at every row count measured, 8 to 2,048 (docs/benchmark-log.md 2026-12-02 14:02)."""
    return 64 if cpu_has_amx_bf16() else 1


def onednn_bf16_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 GEMMs on `device` can take prepacked weights: a CPU torch built with oneDNN, on a CPU
    oneDNN runs bf16 on (AVX-512 at least)."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnWeight:
    """y = x @ W^T for bf16 x [M, in] and W [out, in]. Invariant: the result equals F.linear(x, W) exactly
    (within a bf16 rounding on AMX CPUs: see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), onednn_batch_hint())

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] bf16 (+ bias [out], added inside the GEMM) -> [M, out] bf16."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    def dense(self) -> torch.Tensor:
        """The plain [out, in] bf16 values (a new tensor)."""
        return self.packed.to_dense()


class OneDnnLinear(nn.Module):
    """nn.Linear's forward on a OneDnnWeight, bias added inside the GEMM as F.linear does (bit for bit its
    result). `weight` gives the plain values back (a copy, for inspection).

    With `float32_min_rows` (CPUs whose float32 GEMMs beat bf16 ones, layers/prompt_gemm.py) the layer also keeps
    a float32 copy of the weight ([in, out] layout), and calls of at least that many rows multiply the rows,
    widened exactly, by it in float32 and round the result to bf16 once: twice the weight bytes read, so only
    where a GEMM is compute-bound; fewer rows keep the bf16 GEMM, bit for bit F.linear."""

    def __init__(self, linear: nn.Linear, float32_min_rows: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.onednn = OneDnnWeight(linear.weight.detach())
        self.bias = linear.bias
        self.float32_min_rows = float32_min_rows
        self.float32_weight = linear.weight.detach().float().t().contiguous().t() if float32_min_rows else None

    @property
    def weight(self) -> torch.Tensor:
        return self.onednn.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        wide = self._float32(rows)
        out = self.onednn.linear(rows, self.bias) if wide is None else wide.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """As an output head (llama.py's logits): F.linear(x, W).float(), bit for bit (the float32 sums, not
        rounded to bf16, on the float32 copy's rows)."""
        rows = x.reshape(-1, self.in_features)
        wide = self._float32(rows)
        out = self.onednn.linear(rows, self.bias).float() if wide is None else wide
        return out.view(*x.shape[:-1], self.out_features)

    def _float32(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self.float32_weight is None or rows.shape[0] < self.float32_min_rows:
            return None
        bias = None if self.bias is None else self.bias.float()
        return F.linear(rows.float(), self.float32_weight, bias)


def bf16_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every bf16 nn.Linear oneDNN takes in the decoder layers (`model.layers`), and of
    an untied output layer (`lm_head`, parent the model) first. A tied output layer is the embedding table."""
    found = []
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and getattr(model, "output_head", None) is None \
            and onednn_bf16_applies(head.weight.dtype, head.weight.device):
        found.append((model, "lm_head", head))
    for layer in getattr(model, "layers", ()):
        for parent in list(layer.modules()):
            found += [(parent, name, child) for name, child in parent.named_children()
                      if isinstance(child, nn.Linear) and onednn_bf16_applies(child.weight.dtype, child.weight.device)]
    return found


def amx_onednn_copies(model: nn.Module, available_bytes: int) -> bool:
    """Whether the Bf16Linear layers of `model` should also keep copies for many rows (_add_amx_copy: packed for
    AMX tiles, else oneDNN's): on a CPU with AMX (bf16_linear.py: oneDNN's tile kernels win from
    ONEDNN_MIN_ROWS rows), where the copies fit (copy_fits)."""
    if not cpu_has_amx_bf16():
        return False
    copy_bytes = 2 * sum(linear.weight.numel() for parent, name, linear in bf16_linears(model)
                         if not (name == "lm_head" and parent is model))
    head = _dense_head_weight(model) if getattr(model, "output_head", None) is None else None  # else packed
    copy_bytes += 0 if head is None else head_copy_bytes(head)
    return copy_bytes > 0 and copy_fits(copy_bytes, available_bytes,
                                        "decode steps of many rows without AMX tiles: a prepacked copy of the weights")


@torch.no_grad()
def prepack_bf16_linears(model: nn.Module, float32_min_rows: int | None = None, onednn_copies: bool = False) -> int:
    """Replaces the layers bf16_linears finds: on a CPU with AVX512_BF16 (and no float32 copies asked for) by
    Bf16Linear, plain weights run by kvpilot's kernel at few rows (with `onednn_copies`, the decoder projections
    also keep a prepacked copy for many rows: amx_onednn_copies), and a tied output layer (the embedding table)
    gets one too as the model's `output_head`; elsewhere by OneDnnLinear (with `float32_min_rows`: and a float32
    copy for calls of that many rows). An untied output layer becomes the model's `output_head` either way.
    Returns how many layers were replaced (a CPU model's; none elsewhere)."""
    found = bf16_linears(model)
    kernel = bf16_gemm_kernel(torch.bfloat16, torch.device("cpu")) if found and float32_min_rows is None else None
    for parent, name, linear in found:
        head = name == "lm_head" and parent is model
        if kernel is None:
            setattr(parent, name, OneDnnLinear(linear, float32_min_rows))
        else:
            layer = Bf16Linear.from_linear(linear, kernel)
            if onednn_copies:
                _add_amx_copy(layer, linear.weight, kernel, head)
            setattr(parent, name, layer)
        if head:
            model.output_head = model.lm_head
    table = _dense_head_weight(model) if getattr(model, "lm_head", None) is None else None
    if kernel is not None and table is not None and getattr(model, "output_head", None) is None:
        model.output_head = Bf16Linear(table, None, kernel)  # the table itself, shared with the lookup
        if onednn_copies:
            _add_amx_copy(model.output_head, table, kernel, head=True)
    return len(found)


def head_copy_bytes(weight: torch.Tensor) -> int:
    """The bytes of the copy _add_amx_copy gives an output head of `weight` on this CPU."""
    tiles = amx_tiles_kernel(get_bf16_ops(), weight) is not None
    return (2 if tiles else 4) * weight.numel()


def _add_amx_copy(layer: Bf16Linear, weight: torch.Tensor, kernel: Any, head: bool) -> None:
    """An AMX CPU's copy for many rows: packed for the kernel module's tiles where it can use them, else a
    oneDNN-prepacked copy (a decoder projection) or a float32 copy for oneDNN's bf16 math mode (an output head,
    whose float32 logits oneDNN's bf16 GEMM cannot give)."""
    if amx_tiles_kernel(kernel, weight) is not None:
        layer.tiles = AmxTileWeight(weight, kernel)
    elif head:
        layer.float32_copy = weight.detach().float()
    else:
        layer.onednn = OneDnnWeight(weight.detach())


def _dense_head_weight(model: nn.Module) -> torch.Tensor | None:
    """The bf16 CPU weight of `model`'s output layer (the embedding table when tied), None when it has none or
    the layer is packed or of another dtype or device."""
    output_weight = getattr(model, "output_weight", None)
    weight = output_weight() if callable(output_weight) else None
    if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return weight
