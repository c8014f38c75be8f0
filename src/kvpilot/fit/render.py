"""Rich tables for a FitReport and for the GPU comparison."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvpilot.fit import units
from kvpilot.fit.calibration import DeviceRates, MachineProfile
from kvpilot.fit.model_catalog import get_repo_id
from kvpilot.fit.plan import FitReport, GpuComparison
from kvpilot.fit.serve_command import kvpilot_serve_commands, unservable_reason
from kvpilot.fit.server_capacity import CapacityComparison


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    return table


def _model_table(r: FitReport) -> Table:
    m, p = r.model, r.model.params
    t = _table(f"Model: {m.spec.name}  ({m.source})")
    params = units.count(p.num_total)
    if m.spec.is_moe:
        params += f" total, {units.count(p.num_active)} active"
    t.add_row("parameters", params)
    t.add_row("weights", escape(f"{units.gb_and_gib(r.memory.weights.num_bytes)}  [{r.memory.weights.format_name}]"))
    t.add_row("KV per token", f"{r.kv_bytes_per_token_unsplit:,} bytes ({r.memory.kv_dtype_bytes}-byte elements)")
    d = r.group.device
    t.add_row("device", f"{r.group.count} x {d.name}: {units.gib(d.memory_bytes)}, "
              f"{units.bandwidth(d.bandwidth_bytes_per_s)}, {units.flops(d.bf16_flops)} bf16 ({rates_word(r)})")
    return t


def rates_word(r: FitReport) -> str:
    """"calibrated" (this machine's measured rates) or "nominal" (datasheet / default rates)."""
    return "calibrated" if r.group.device.calibrated else "nominal"


def _memory_table(r: FitReport) -> Table:
    m = r.memory
    t = _table(f"Memory per device (tp={m.parallelism.tensor_parallel_size}, "
               f"pp={m.parallelism.pipeline_parallel_size})")
    t.add_row("total", units.gib(m.total_bytes))
    if m.fixed_kv_bytes is None:
        t.add_row(f"budget (x{r.inputs.gpu_memory_utilization:g})", units.gib(m.budget_bytes))
    t.add_row("- weights", units.gib(m.weight_bytes_per_device))
    t.add_row("- activation peak", units.gib(m.activation_bytes))
    t.add_row("- runtime", units.gib(m.runtime_bytes))
    style = "green" if m.kv_budget_bytes > 0 else "red"
    if m.fixed_kv_bytes is None:
        t.add_row("= KV cache", Text(units.gib(m.kv_budget_bytes), style=style))
    else:
        free = m.budget_bytes - m.weight_bytes_per_device - m.activation_bytes - m.runtime_bytes
        t.add_row("= free", units.gib(free))
        t.add_row("KV cache (fixed size)", Text(units.gib(m.kv_budget_bytes), style=style))
    t.add_row("KV capacity", f"{m.num_kv_blocks:,} blocks x {m.block_size} = {m.num_kv_tokens:,} tokens")
    return t


def _capacity_table(r: FitReport) -> Table:
    m, i = r.memory, r.inputs
    t = _table(f"Capacity for {i.input_len:,} in + {i.output_len:,} out tokens")
    fits = Text("yes" if m.fits_workload else "no", style="green" if m.fits_workload else "red")
    t.add_row(f"{i.concurrency} concurrent requests fit", fits)
    t.add_row("KV margin at that concurrency", units.gib(m.workload_margin_bytes))
    t.add_row("max concurrent requests", f"{m.max_num_requests:,}")
    t.add_row(f"max context at {i.concurrency} concurrent", f"{m.max_context_at_concurrency:,} tokens")
    t.add_row("max context for one request", f"{m.max_context_single_request:,} of {m.max_model_len:,}")
    t.add_row(f"{r.group.device.name} devices needed", str(r.min_devices or "more than 64"))
    return t


def _roofline_table(r: FitReport) -> Table | None:
    rl = r.roofline
    if rl is None:
        return None
    t = _table(f"Roofline (upper bounds, {rates_word(r)} rates)")
    if r.group.device.step_overhead_seconds:
        t.add_row("step overhead (measured)", units.seconds(r.group.device.step_overhead_seconds))
    t.add_row("prefill", f"{units.rate(rl.prefill_tokens_per_s)}; TTFT >= {units.seconds(rl.ttft_seconds)}")
    one, many = rl.decode_single, rl.decode_at_concurrency
    t.add_row("decode, 1 sequence", f"{units.rate(one.tokens_per_s_per_sequence)} ({one.bound})")
    t.add_row(f"decode, batch {many.batch_size}",
              f"{units.rate(many.tokens_per_s_aggregate)} total, "
              f"{units.rate(many.tokens_per_s_per_sequence)} each ({many.bound})")
    crossover = rl.compute_bound_batch_size
    t.add_row("compute-bound from batch", f"{crossover:,}" if crossover else "never (KV reads dominate)")
    if rl.cost_per_million_output_tokens is not None:
        t.add_row("cost per 1M output tokens", f"{rl.cost_per_million_output_tokens:,.3f}")
    return t


def _model_ref(r: FitReport) -> str:
    try:
        return get_repo_id(r.model.spec.name)
    except ValueError:
        return r.model.source.split(" ")[-1]


def _flag_lines(r: FitReport) -> list[str]:
    if r.flags is None:
        return []
    ref = _model_ref(r)
    lines = ["vllm serve " + shlex.join([ref, *r.flags.vllm_args()])]
    if r.flags.tensor_parallel_size * r.flags.pipeline_parallel_size == 1:  # kvpilot runs on one device
        lines += [command.line() for command in kvpilot_serve_commands(r.model, r.flags.kvpilot_args())]
        reason = unservable_reason(r.model)
        if reason is not None:
            lines.append(f"# no kvpilot serve line: {reason}")
    return lines


def render_report(r: FitReport, console: Console) -> None:
    parts = [_model_table(r), _memory_table(r), _capacity_table(r), _roofline_table(r)]
    console.print(Group(*[p for p in parts if p is not None]))
    lines = _flag_lines(r)
    if lines:
        console.print("Recommended flags", style="bold")
        for line in lines:  # unwrapped, so the command can be copied whole
            console.print(Text(line), soft_wrap=True)
    for note in r.notes:
        console.print(Text(f"note: {note}", style="yellow"))


def render_comparison(rows: list[GpuComparison], console: Console) -> None:
    table = Table(title="GPUs ranked by decode throughput per device (roofline bounds)", title_justify="left")
    for name in ("GPU", "count", "KV tokens", "TTFT", "decode/seq", "total decode", "per device"):
        table.add_column(name, justify="left" if name == "GPU" else "right")
    for row in rows:
        r = row.report
        if r is None or r.roofline is None:
            table.add_row(row.gpu, "-", "does not fit on 64", "", "", "", "")
            continue
        rl = r.roofline
        table.add_row(row.gpu, str(r.group.count), f"{r.memory.num_kv_tokens:,}", units.seconds(rl.ttft_seconds),
                      units.rate(rl.decode_at_concurrency.tokens_per_s_per_sequence),
                      units.rate(rl.decode_at_concurrency.tokens_per_s_aggregate),
                      units.rate(row.tokens_per_s_per_device))
    console.print(table)


def render_capacity_comparison(c: CapacityComparison, console: Console) -> None:
    table = Table(title=f"KV capacity of {c.model}: predicted vs actual", title_justify="left")
    for name in ("quantity", "predicted", "actual"):
        table.add_column(name, justify="left" if name == "quantity" else "right")
    for name, predicted, actual in c.rows():
        style = None if predicted == actual else "red"
        table.add_row(name, f"{predicted:,}", Text(f"{actual:,}", style=style or ""))
    console.print(table)


def _rates_rows(t: Table, rates: DeviceRates) -> None:
    t.add_row(f"{rates.name}: memory bandwidth", units.bandwidth(rates.bandwidth_bytes_per_s))
    t.add_row("  bf16 GEMM", units.flops(rates.bf16_flops))
    t.add_row("  float32 GEMM", units.flops(rates.fp32_flops))
    t.add_row("  engine step overhead", units.seconds(rates.step_overhead_seconds))


def render_calibration(profile: MachineProfile, path: Path, console: Console) -> None:
    console.print(Text(f"Calibrated: {profile.fingerprint.describe()}", style="bold"))
    t = _table("")
    _rates_rows(t, profile.cpu)
    if profile.gpu is not None:
        _rates_rows(t, profile.gpu)
        t.add_row("  fit catalog entry", profile.gpu.catalog_name or "none (fit --gpu cannot name it)")
    console.print(t)
    console.print(Text(f"stored in {path}: `kvpilot fit` and `kvpilot doctor` use it on this machine"))
