from __future__ import annotations

from rich.console import Console

from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.model_source import load_model
from kvpilot.fit.plan import GpuComparison, build_report
from kvpilot.fit.render import render_capacity_comparison, render_comparison, render_report
from kvpilot.fit.server_capacity import compare_capacity
from kvpilot.fit.workload import FitInputs


def _console() -> Console:
    return Console(record=True, width=200)


def test_report_without_a_fit_shows_the_miss_and_no_flags() -> None:
    console = _console()
    render_report(build_report(load_model("llama-3.1-70b"), parse_device_arg("l4"), FitInputs()), console)
    text = console.export_text()
    assert "= KV cache" in text and "-" in text.split("= KV cache")[1].splitlines()[0]
    assert "Recommended flags" not in text and "Roofline" not in text
    assert "l4 devices needed" in text


def test_comparison_lists_gpus_that_do_not_fit() -> None:
    console = _console()
    report = build_report(load_model("smollm2-135m"), parse_device_arg("l4"), FitInputs())
    render_comparison([GpuComparison("l4", report), GpuComparison("tiny", None)], console)
    text = console.export_text()
    assert "does not fit on 64" in text and text.index("l4") < text.index("tiny")


def test_capacity_comparison_table() -> None:
    console = _console()
    server = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64, "kv_dtype_bytes": 2,
              "kv_cache_memory_bytes": 2**30, "block_size": 16, "num_blocks": 2900, "max_model_len": 8192}
    render_capacity_comparison(compare_capacity(server), console)
    text = console.export_text()
    assert "predicted vs actual" in text and "2,912" in text and "2,900" in text
