"""Roofline bounds: the fastest prefill and decode the hardware allows, ignoring kernel inefficiency.

Decode step at batch B, average context c, per device (all devices work in parallel):
    memory time  = (weights read + B * KV bytes of one sequence at c) / bandwidth
    compute time = B * FLOPs per token / FLOP/s
    step time    = max(memory, compute);  per-sequence tok/s = 1/step;  aggregate = B/step
Weights read per step: every layer's weights, the lm_head (the tied embedding when tied), and for MoE
only the experts some sequence in the batch routes to: E * (1 - (1 - k/E)^B) per layer on average.
FLOPs per token: 2 x the matrix weights a token multiplies + attention 2 * layers * heads * c * (qk + v dims)
(MLA decode uses the absorbed latent form: qk = kv_lora_rank + rope dim, v = kv_lora_rank).
Prefill of P tokens: compute 2 x weights x P + causal attention (half of P^2); memory reads all weights once.
Compute peak: fp8 tensor cores when weights are fp8 and the device has them, otherwise bf16 (weight-only
int8/int4/GGUF formats multiply in 16-bit). A calibrated device (kvpilot.fit.calibration) also knows its float32
GEMM rate: fp32 weights multiply at it, and 16-bit ones at the faster of the two (kvpilot's CPU prompt GEMMs
run in float32 where that is faster, model/layers/prompt_gemm.py); its measured per-step overhead is added
to every step (nominal devices have none).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.hardware import DeviceGroup
from kvpilot.fit.kv_cache import kv_bytes_per_sequence
from kvpilot.fit.memory import MemoryPlan
from kvpilot.fit.model_source import LoadedModel
from kvpilot.fit.model_spec import ModelSpec, MoeDims

MAX_BATCH_SEARCHED = 1 << 16


@dataclass(frozen=True)
class DecodePoint:
    """Decode bound at one batch size. Invariant: aggregate == batch * per_sequence."""

    batch_size: int
    step_seconds: float
    memory_seconds: float
    compute_seconds: float
    tokens_per_s_per_sequence: float
    tokens_per_s_aggregate: float
    overhead_seconds: float = 0.0

    @property
    def bound(self) -> str:
        if self.overhead_seconds >= max(self.compute_seconds, self.memory_seconds):
            return "step overhead"
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory bandwidth"


@dataclass(frozen=True)
class Roofline:
    """Bounds for the workload. compute_bound_batch_size is None when decode never turns compute-bound
    (the KV reads grow as fast as the compute)."""

    peak_flops: float
    bandwidth_bytes_per_s: float
    prefill_tokens_per_s: float
    ttft_seconds: float
    decode_single: DecodePoint
    decode_at_concurrency: DecodePoint
    compute_bound_batch_size: int | None
    cost_per_million_output_tokens: float | None


def _expected_experts(moe: MoeDims, batch: int) -> float:
    """Distinct experts per layer that `batch` tokens route to, with uniform independent routing."""
    e, k = moe.num_experts, moe.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def weights_read_bytes(model: LoadedModel, plan: MemoryPlan, batch: int) -> float:
    """Weight bytes read by one step over `batch` tokens, whole model (input embedding rows ignored)."""
    w, spec = plan.weights, model.spec
    head = w.num_bytes_lm_head if w.num_bytes_lm_head else w.num_bytes_embedding
    layers = float(w.num_bytes_layers)
    if spec.moe is not None and w.num_bytes_expert:
        idle_experts = spec.moe.num_experts - _expected_experts(spec.moe, batch)
        layers -= model.params.num_moe_layers * w.num_bytes_expert * idle_experts
    return layers + head


def _attention_dims(spec: ModelSpec) -> tuple[int, int]:
    if spec.mla is not None:
        return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim, spec.mla.kv_lora_rank
    return spec.head_dim, spec.head_dim


def flops_per_token(model: LoadedModel, context: int) -> float:
    """FLOPs to produce one token attending to `context` earlier tokens."""
    spec, p = model.spec, model.params
    matrix = p.num_active - p.num_embedding - p.num_vector + (p.num_embedding if not p.num_lm_head else 0)
    qk, v = _attention_dims(spec)
    full_layers = spec.num_hidden_layers - spec.num_sliding_layers
    window = min(context, spec.sliding_window or context)
    attended = full_layers * context + spec.num_sliding_layers * window
    return 2 * matrix + 2 * spec.num_attention_heads * attended * (qk + v)


def _peak_flops(group: DeviceGroup, plan: MemoryPlan) -> float:
    """FLOP/s of the whole group."""
    device = group.device
    if plan.weights.format_name == "fp8" and device.fp8_flops is not None:
        return device.fp8_flops * group.count
    if device.fp32_flops is None:
        return device.bf16_flops * group.count
    if plan.weights.format_name == "fp32":
        return device.fp32_flops * group.count
    return max(device.bf16_flops, device.fp32_flops) * group.count


def decode_point(model: LoadedModel, group: DeviceGroup, plan: MemoryPlan, batch: int, context: int) -> DecodePoint:
    """Decode bound for `batch` sequences at `context` tokens each, per device (devices run in parallel)."""
    par = plan.parallelism
    kv_per_device = batch * kv_bytes_per_sequence(
        model.spec, context, plan.kv_dtype_bytes, par.tensor_parallel_size, 1) / par.pipeline_parallel_size
    weights_per_device = weights_read_bytes(model, plan, batch) / par.num_devices
    memory = (weights_per_device + kv_per_device) / group.device.bandwidth_bytes_per_s
    compute = batch * flops_per_token(model, context) / _peak_flops(group, plan)
    overhead = group.device.step_overhead_seconds
    step = max(memory, compute) + overhead
    return DecodePoint(batch, step, memory, compute, 1 / step, batch / step, overhead)


def compute_bound_batch(model: LoadedModel, group: DeviceGroup, plan: MemoryPlan, context: int) -> int | None:
    """Smallest batch where decode compute time reaches memory time (doubling, then bisection)."""
    def compute_bound(b: int) -> bool:
        point = decode_point(model, group, plan, b, context)
        return point.compute_seconds >= point.memory_seconds
    hi = 1
    while not compute_bound(hi):
        hi *= 2
        if hi > MAX_BATCH_SEARCHED:
            return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


def prefill_seconds(model: LoadedModel, group: DeviceGroup, plan: MemoryPlan, prompt_len: int) -> float:
    """TTFT bound for one prompt on an idle server: max(compute, one read of the weights), plus one step's
    overhead on a calibrated device.

    Prefill attention is not absorbed for MLA: it uses the full q/k (nope + rope) and v head dims."""
    spec, p = model.spec, model.params
    if spec.mla is not None:
        qk, v = spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim, spec.mla.v_head_dim
    else:
        qk, v = spec.head_dim, spec.head_dim
    head_flops = 2 * (p.num_lm_head or p.num_embedding)
    linear = (flops_per_token(model, 0) - head_flops) * prompt_len + head_flops  # logits for the last token only
    window = min(prompt_len, spec.sliding_window or prompt_len)
    # causal attention: position i attends to i tokens -> sum ~ P^2 / 2, times 2 FLOPs per multiply-add
    full_layers = spec.num_hidden_layers - spec.num_sliding_layers
    attended = full_layers * prompt_len * prompt_len / 2 + spec.num_sliding_layers * prompt_len * window
    attention = 2 * spec.num_attention_heads * attended * (qk + v)
    compute = (linear + attention) / _peak_flops(group, plan)
    memory = weights_read_bytes(model, plan, prompt_len) / (group.device.bandwidth_bytes_per_s * group.count)
    return max(compute, memory) + group.device.step_overhead_seconds


def roofline(model: LoadedModel, group: DeviceGroup, plan: MemoryPlan, input_len: int, output_len: int,
             concurrency: int, price_per_hour: float | None) -> Roofline:
    """All bounds for the workload; decode at `concurrency` is capped by the requests that fit in KV."""
    context = input_len + output_len // 2
    batch = max(1, min(concurrency, plan.max_num_requests))
    ttft = prefill_seconds(model, group, plan, input_len)
    at_batch = decode_point(model, group, plan, batch, context)
    cost = None
    if price_per_hour is not None:
        cost = price_per_hour * group.count / (at_batch.tokens_per_s_aggregate * 3600) * 1e6
    return Roofline(
        peak_flops=_peak_flops(group, plan),
        bandwidth_bytes_per_s=group.device.bandwidth_bytes_per_s * group.count,
        prefill_tokens_per_s=input_len / ttft,
        ttft_seconds=ttft,
        decode_single=decode_point(model, group, plan, 1, context),
        decode_at_concurrency=at_batch,
        compute_bound_batch_size=compute_bound_batch(model, group, plan, context),
        cost_per_million_output_tokens=cost,
    )
