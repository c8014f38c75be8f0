"""Per-layer, per-KV-head scales of an fp8 KV cache: the cache stores value / scale, so each head's keys and
values use fp8's range (normal numbers from 2^-6 to 448, 3 mantissa bits) however large or small they are.

Scales are powers of two. Dividing by one, and folding it into the queries and the attention output, is then
exact in bf16, fp16 and float32: a layer with scales s_k, s_v computes what it would with scale 1 except for
the cache's own rounding, with scores = (q * s_k) . (k / s_k) and out = s_v * sum(p * (v / s_v)). So no
attention kernel reads a scale: `KvScales.attend` folds them around any backend (four elementwise products a
layer; StepAttention calls it with the runner's scales), and a CUDA graph captured before calibration replays
them, since they are updated in place.

Where scales come from: a checkpoint's per-layer `k_scale` / `v_scale` (llm-compressor's `kv_cache_scheme`,
vLLM's fp8 checkpoints), rounded up to a power of two (`set_scales`); otherwise calibrated from the first real
step (`ModelRunner.execute_model`, never a profiling or capture run), each head's largest |K| and |V| mapped
into (TARGET / 2, TARGET]: 16x below fp8's largest value, headroom for larger values later (the cast
saturates beyond it). Scales never change once set: entries written with one scale are read with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvpilot.model.attention.base import LayerAttention

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TARGET = FP8_MAX / 16


def power_of_two_at_least(value: float) -> float:
    """The smallest power of two >= value (value > 0)."""
    return 2.0 ** math.ceil(math.log2(value))


class KvScales:
    """One layer's K and V scales (num_kv_heads each), as the four factors `attend` multiplies by: queries by
    s_k (per query head), keys by 1/s_k, values by 1/s_v, the output by s_v (per query head). Invariant: every
    factor is a power of two; `frozen` once set (calibrated or loaded)."""

    def __init__(self, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        self.group = num_heads // num_kv_heads
        ones = torch.ones(num_kv_heads, dtype=torch.float32)
        self.k_scale, self.v_scale = ones.clone(), ones.clone()
        self.q_mul = torch.ones(num_heads, 1, dtype=dtype, device=device)
        self.k_mul = torch.ones(num_kv_heads, 1, dtype=dtype, device=device)
        self.v_mul = torch.ones(num_kv_heads, 1, dtype=dtype, device=device)
        self.out_mul = torch.ones(num_heads, 1, dtype=dtype, device=device)
        self.frozen = False
        self.identity = False  # set and all 1: nothing to fold (set before any graph is captured: see attend)

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Fixes the scales (a scalar or one per KV head each), each rounded up to a power of two."""
        if self.frozen:
            raise RuntimeError("KV scales are already set: the cache holds entries written with them")
        k = torch.as_tensor(k_scale, dtype=torch.float32).expand(self.k_scale.shape)
        v = torch.as_tensor(v_scale, dtype=torch.float32).expand(self.v_scale.shape)
        if not (bool((k > 0).all()) and bool((v > 0).all())):
            raise ValueError(f"KV cache scales must be positive, got k_scale={k.tolist()}, v_scale={v.tolist()}")
        self.k_scale = torch.tensor([power_of_two_at_least(x) for x in k.tolist()])
        self.v_scale = torch.tensor([power_of_two_at_least(x) for x in v.tolist()])
        group = self.group
        self.q_mul.copy_(self.k_scale.repeat_interleave(group)[:, None])  # in place: graphs read these
        self.k_mul.copy_((1.0 / self.k_scale)[:, None])
        self.v_mul.copy_((1.0 / self.v_scale)[:, None])
        self.out_mul.copy_(self.v_scale.repeat_interleave(group)[:, None])
        self.frozen = True
        self.identity = bool((self.k_scale == 1).all() and (self.v_scale == 1).all())

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sets the scales from this step's keys and values ([T, kv_heads, D]): each head's largest magnitude
        into (TARGET / 2, TARGET]; a head of zeros keeps scale 1."""
        k_max = k.detach().abs().amax(dim=(0, 2)).float().cpu()
        v_max = v.detach().abs().amax(dim=(0, 2)).float().cpu()
        self.set_scales(torch.where(k_max > 0, k_max / TARGET, 1.0), torch.where(v_max > 0, v_max / TARGET, 1.0))

    def attend(self, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: Any, layer: LayerAttention, calibrate: bool) -> torch.Tensor:
        """The backend's forward with the scales folded in (calibrating first when `calibrate` and not set)."""
        if calibrate and not self.frozen:
            self.calibrate(k, v)
        if self.identity:  # fixed at 1 from the start (make_kv_scales(frozen_at_one)): graphs never fold
            return backend.forward(q, k, v, kv_cache, meta, layer)
        out = backend.forward(q * self.q_mul, k * self.k_mul, v * self.v_mul, kv_cache, meta, layer)
        return out * self.out_mul


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: those with a `layer_attention` and their head counts, in module order."""
    return [m for m in model.modules()
            if hasattr(m, "num_heads") and hasattr(m, "num_kv_heads") and hasattr(m, "layer_attention")]


def make_kv_scales(model: nn.Module, dtype: torch.dtype, device: torch.device, frozen_at_one: bool = False,
                   checkpoint: dict[int, tuple[float, float]] | None = None) -> dict[int, KvScales]:
    """One runner's scales: a KvScales per layer, keyed by the id of its LayerAttention (what StepAttention is
    called with), in layer order. Owned by the runner, not the model: runners sharing a model (LLM(loaded=...))
    with other KV dtypes never see them. frozen_at_one: scales fixed at 1 (K/V that other processes write or
    read: a disaggregated worker). checkpoint: fixed scales by layer index (a layer without any is calibrated,
    or 1 with frozen_at_one)."""
    made: dict[int, KvScales] = {}
    for index, module in enumerate(attention_modules(model)):
        scales = KvScales(module.num_heads, module.num_kv_heads, dtype, device)
        if checkpoint and index in checkpoint:
            scales.set_scales(*(torch.tensor(x) for x in checkpoint[index]))
        elif frozen_at_one:
            scales.set_scales(torch.tensor(1.0), torch.tensor(1.0))
        made[id(module.layer_attention)] = scales
    return made
