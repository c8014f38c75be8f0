"""Reading one linear layer's 4-bit tensors from an AWQ, GPTQ or compressed-tensors checkpoint into an Int4Weight.

The layouts (as the tools write them; documented by AutoAWQ, AutoGPTQ/GPTQModel and compressed-tensors):
- AWQ GEMM: qweight int32 [K, N / 8] packed along the outputs in AWQ's interleaved order (nibble j of word c
  holds column 8c + AWQ_ORDER[j]), qzeros int32 [G, N / 8] packed alike, scales [G, N];
- GPTQ: qweight int32 [K / 8, N] packed along the inputs (nibble j of word r: row 8r + j), qzeros int32
  [G, N / 8] packed along the outputs in order, stored one less than used in v1 (`gptq`), scales [G, N],
  g_idx int32 [K] (each input column's group; act-order checkpoints permute it);
- compressed-tensors pack-quantized: weight_packed int32 [N, K / 8] packed along the inputs in order, values
  stored as signed + 8; weight_scale [N, G]; asymmetric weight_zero_point int32 [N / 8, G] packed along the
  outputs (older files: int8 [N, G]), signed + 8 too; weight_g_idx [K] for act-order; weight_shape [N, K].
"""

from __future__ import annotations

import torch

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.quant.checkpoint_scheme import Int4Scheme
from kvpilot.model.quant.int4_weight import Int4Weight, pack_rows, plain_g_idx, unpack_cols, unpack_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# the tensors each layout needs, then the ones it may have
LAYOUT_TENSORS = {"awq": (("qweight", "qzeros", "scales"), ()),
                  "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
                  "pack": (("weight_packed", "weight_scale"), ("weight_zero_point", "weight_g_idx", "weight_shape"))}


def read_int4(tensors: dict[str, torch.Tensor], scheme: Int4Scheme, name: str) -> Int4Weight:
    """The Int4Weight of module `name` from its tensors (suffix -> tensor); ModelLoadError on a shape or dtype
    that does not fit the layout."""
    reader = {"awq": _awq, "gptq": _gptq, "pack": _pack}[scheme.layout]
    try:
        weight = reader(tensors, scheme)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{name}: its {scheme.method} tensors do not fit the layout ({exc})") from exc
    _check(weight, scheme, name)
    return weight


def _deinterleave(nibbles: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, N] nibble-order columns -> columns in order."""
    rows, n = nibbles.shape
    out = torch.empty_like(nibbles)
    out.view(rows, n // 8, 8)[:, :, list(AWQ_ORDER)] = nibbles.view(rows, n // 8, 8)
    return out


def _awq(t: dict[str, torch.Tensor], scheme: Int4Scheme) -> Int4Weight:
    q = _deinterleave(unpack_cols(_int32(t["qweight"])))  # [K, N]
    zeros = _deinterleave(unpack_cols(_int32(t["qzeros"])))  # [G, N]
    return Int4Weight(pack_rows(q), t["scales"].to(torch.float32), zeros.to(torch.uint8),
                      plain_g_idx(q.shape[0], scheme.group_size))


def _gptq(t: dict[str, torch.Tensor], scheme: Int4Scheme) -> Int4Weight:
    qweight = _int32(t["qweight"]).contiguous()
    zeros = unpack_cols(_int32(t["qzeros"]))[:, : qweight.shape[1]] + scheme.zero_offset  # words pad N to 8s
    in_features = qweight.shape[0] * 8
    g_idx = t.get("g_idx")
    g_idx = plain_g_idx(in_features, scheme.group_size) if g_idx is None else g_idx.to(torch.int32)
    return Int4Weight(qweight, t["scales"].to(torch.float32), zeros.to(torch.uint8), g_idx.contiguous())


def _pack(t: dict[str, torch.Tensor], scheme: Int4Scheme) -> Int4Weight:
    packed, scale = _int32(t["weight_packed"]), t["weight_scale"].to(torch.float32)
    shape = t.get("weight_shape")
    n, k = (int(v) for v in shape.tolist()) if shape is not None else (packed.shape[0], packed.shape[1] * 8)
    if k % 8:
        raise ValueError(f"{k} input features: kvpilot packs 8 to a word")
    q = unpack_cols(packed)[:, :k]  # [N, K], unsigned
    groups = scale.shape[1]
    zero = t.get("weight_zero_point")
    if scheme.symmetric or zero is None:
        zeros = torch.full((n, groups), 8, dtype=torch.int32)
    elif zero.dtype == torch.int32:  # packed along the outputs, unsigned
        zeros = unpack_rows(zero)[:n]
    else:  # older files: one signed int8 a group
        zeros = zero.to(torch.int32).reshape(n, groups) + 8
    g_idx = t.get("weight_g_idx")
    g_idx = plain_g_idx(k, scheme.group_size) if g_idx is None else g_idx.to(torch.int32)
    return Int4Weight(pack_rows(q.t()), scale.t().contiguous(), zeros.t().contiguous().to(torch.uint8),
                      g_idx.contiguous())


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in (torch.int32, torch.uint32):
        raise ValueError(f"packed tensors are int32, got {t.dtype}")
    return t.view(torch.int32)


def _check(w: Int4Weight, scheme: Int4Scheme, name: str) -> None:
    k, n = w.in_features, w.out_features
    groups = w.scales.shape[0]
    expected = 1 if scheme.group_size is None else -(-k // scheme.group_size)
    problems = []
    if w.scales.shape != (groups, n) or w.zeros.shape != (groups, n):
        problems.append(f"scales {tuple(w.scales.shape)} and zero points {tuple(w.zeros.shape)} for "
                        f"{n} outputs")
    if not scheme.act_order and groups != expected:
        problems.append(f"{groups} groups where {k} inputs in groups of {scheme.group_size} make {expected}")
    if w.g_idx.numel() and (int(w.g_idx.min()) < 0 or int(w.g_idx.max()) >= groups):
        problems.append(f"g_idx outside 0..{groups - 1}")
    if problems:
        raise ModelLoadError(f"{name}: {scheme.method} tensors do not fit together: {'; '.join(problems)}")
