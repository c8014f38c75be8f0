"""FitReport: everything `kvpilot fit` answers for one model on one device group, and the GPU ranking."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.fit.errors import FitError
from kvpilot.fit.hardware import GPUS, DeviceGroup
from kvpilot.fit.kv_cache import kv_bytes_per_token
from kvpilot.fit.memory import MemoryPlan, plan_memory
from kvpilot.fit.model_source import LoadedModel
from kvpilot.fit.recommend import RecommendedFlags, recommend_flags
from kvpilot.fit.roofline import Roofline, roofline
from kvpilot.fit.workload import FitInputs

DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class FitReport:
    """Answers for one deployment. Invariant: roofline and flags are None exactly when the weights do
    not fit; min_devices is None when no count in DEVICE_COUNTS serves the workload."""

    model: LoadedModel
    group: DeviceGroup
    inputs: FitInputs
    memory: MemoryPlan
    kv_bytes_per_token_unsplit: int  # whole model, one device's view without tensor parallelism
    min_devices: int | None
    roofline: Roofline | None
    flags: RecommendedFlags | None
    notes: tuple[str, ...]


def _try_plan(model: LoadedModel, group: DeviceGroup, inputs: FitInputs) -> MemoryPlan | None:
    try:
        return plan_memory(model, group, inputs)
    except FitError:  # e.g. a count that does not divide the attention heads
        return None


def min_devices(model: LoadedModel, group: DeviceGroup, inputs: FitInputs) -> int | None:
    """Fewest devices of this kind whose plan serves `concurrency` requests of the workload."""
    for count in DEVICE_COUNTS:
        plan = _try_plan(model, DeviceGroup(group.device, count), inputs)
        if plan is not None and plan.fits_workload:
            return count
    return None


def _notes(report_plan: MemoryPlan, model: LoadedModel, group: DeviceGroup, inputs: FitInputs) -> list[str]:
    notes = list(report_plan.weights.notes)
    if not report_plan.weights_fit:
        notes.append("weights, activations and runtime exceed the memory budget: add devices or quantize.")
    elif not report_plan.max_model_len_fits:
        notes.append(f"a {report_plan.max_model_len:,}-token request does not fit: lower --max-model-len "
                     f"to {report_plan.max_context_single_request:,} or add memory.")
    if report_plan.weights_fit and not report_plan.fits_workload:
        notes.append(f"only {report_plan.max_num_requests} of {inputs.concurrency} concurrent requests fit: "
                     "the rest queue or get preempted.")
        if inputs.kv_cache_dtype == "auto" and report_plan.kv_dtype_bytes > 1 and group.device.fp8_flops:
            notes.append("--kv-cache-dtype fp8 would halve KV bytes per token.")
    fixed_kv = report_plan.fixed_kv_bytes
    if fixed_kv is not None and report_plan.kv_budget_bytes < fixed_kv:
        notes.append(f"the fixed KV size of {fixed_kv:,} bytes exceeds the free memory "
                     f"({max(0, report_plan.kv_budget_bytes):,} bytes): the server would run out of memory.")
    if model.spec.num_sliding_layers:
        notes.append(_sliding_note(model.spec.num_sliding_layers, model.spec.num_hidden_layers,
                                   model.spec.sliding_window))
    if report_plan.parallelism.num_devices > 1:
        notes.append("multi-device bounds assume perfect scaling (no all-reduce or pipeline bubbles).")
    return notes


def _sliding_note(num_sliding: int, num_layers: int, window: int | None) -> str:
    """What kvpilot's KV manager makes of the model's sliding window: capped at the window in every sliding
    layer (an interleaved model's layers form KV groups, engine/kv_groups.py)."""
    if num_sliding == num_layers:
        return f"every layer uses a {window}-token sliding window: a request's KV is capped at the window."
    return (f"{num_sliding} of {num_layers} layers use a {window}-token sliding window: kvpilot keeps their KV "
            f"to the window and the other layers' whole context (a block table per layer kind; "
            f"--disable-hybrid-kv-cache-manager keeps every layer's whole context).")


def check_lengths(model: LoadedModel, inputs: FitInputs) -> None:
    """FitError when the requested lengths exceed what the model supports."""
    model_max = model.context_length
    if inputs.max_model_len is not None and inputs.max_model_len > model_max:
        raise FitError(f"--max-model-len {inputs.max_model_len:,} exceeds {model.spec.name}'s context length "
                       f"({model_max:,}: max_position_embeddings with its RoPE scaling).")
    limit = inputs.max_model_len or model_max
    if inputs.seq_len > limit:
        raise FitError(f"--input-len + --output-len = {inputs.seq_len:,} exceeds the maximum model length "
                       f"({limit:,}); shorten the request or raise --max-model-len.")


def build_report(model: LoadedModel, group: DeviceGroup, inputs: FitInputs) -> FitReport:
    """Plan memory, roofline and flags; FitError for impossible inputs (e.g. TP not dividing heads)."""
    inputs.validate()
    check_lengths(model, inputs)
    plan = plan_memory(model, group, inputs)
    fits = plan.weights_fit and plan.max_num_requests > 0
    rl = flags = None
    if fits:
        rl = roofline(model, group, plan, inputs.input_len, inputs.output_len, inputs.concurrency,
                      inputs.price_per_hour)
        flags = recommend_flags(plan, inputs, model.spec.checkpoint_quantization)
    return FitReport(
        model=model,
        group=group,
        inputs=inputs,
        memory=plan,
        kv_bytes_per_token_unsplit=kv_bytes_per_token(model.spec, plan.kv_dtype_bytes),
        min_devices=min_devices(model, group, inputs),
        roofline=rl,
        flags=flags,
        notes=tuple(_notes(plan, model, group, inputs)),
    )


@dataclass(frozen=True)
class GpuComparison:
    """One catalog GPU at the fewest devices that serve the workload (report None: none does)."""

    gpu: str
    report: FitReport | None

    @property
    def tokens_per_s_per_device(self) -> float:
        if self.report is None or self.report.roofline is None:
            return 0.0
        return self.report.roofline.decode_at_concurrency.tokens_per_s_aggregate / self.report.group.count


def compare_gpus(model: LoadedModel, inputs: FitInputs) -> list[GpuComparison]:
    """Every catalog GPU, ranked by decode throughput per device (a cost-efficiency proxy)."""
    inputs.validate()
    check_lengths(model, inputs)
    rows = []
    for name, device in GPUS.items():
        count = min_devices(model, DeviceGroup(device, 1), inputs)
        report = build_report(model, DeviceGroup(device, count), inputs) if count else None
        rows.append(GpuComparison(name, report))
    return sorted(rows, key=lambda row: row.tokens_per_s_per_device, reverse=True)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def report_to_json(report: FitReport) -> dict[str, Any]:
    """Plain JSON: the dataclass fields plus the derived answers (fits, margins, flags as argv)."""
    data: dict[str, Any] = _jsonable(report)
    del data["model"]["hf_config"]  # the input, not an answer
    p = report.model.params
    data["model"]["params"].update(num_total=p.num_total, num_active=p.num_active)
    m = report.memory
    data["memory"].update(
        num_kv_tokens=m.num_kv_tokens, weights_fit=m.weights_fit, fits_workload=m.fits_workload,
        max_model_len_fits=m.max_model_len_fits, workload_margin_bytes=m.workload_margin_bytes,
        weight_bytes_total=m.weights.num_bytes,
    )
    if report.flags is not None:
        data["flags"]["vllm_args"] = report.flags.vllm_args()
        data["flags"]["kvpilot_args"] = report.flags.kvpilot_args()
    if report.roofline is not None:
        for key in ("decode_single", "decode_at_concurrency"):
            data["roofline"][key]["bound"] = getattr(report.roofline, key).bound
    return data
