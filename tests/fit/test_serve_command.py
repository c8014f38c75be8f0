"""Issue 14: `kvpilot fit ... --gpu ...` recommends `kvpilot serve` lines kvpilot can run as printed: a catalog
model by its hub id (issue 50: downloaded into the HF cache) or as dummy weights; a GGUF or HF directory by
its path. Every printed line parses under `kvpilot serve`'s own flags and passes EngineArgs.check."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from rich.console import Console
from typer.main import get_command

from kvpilot.cli import app
from kvpilot.launch.args import EngineArgs
from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.model_catalog import get_hf_config, list_models
from kvpilot.fit.model_source import LoadedModel, load_model
from kvpilot.fit.plan import build_report
from kvpilot.fit.render import render_report
from kvpilot.fit.workload import FitInputs
from kvpilot.model.config import from_hf_config, unsupported_reason
from kvpilot.model.dummy import dummy_hf_config

ENGINE_FIELDS = ("model", "load_format", "max_model_len", "max_num_seqs", "block_size", "gpu_memory_utilization",
                 "kv_cache_memory")


def _serve_lines(model: LoadedModel, gpu: str) -> list[str]:
    console = Console(record=True, width=500)
    render_report(build_report(model, parse_device_arg(gpu), FitInputs()), console)
    return [line for line in console.export_text().splitlines() if line.startswith("kvpilot serve ")]


def _parse_serve(line: str) -> dict:
    """The line's flags as `kvpilot serve` parses them (typer's parser raises on an unknown flag or a bad
    value); the engine's part then passes the checks `kvpilot serve` runs before loading."""
    argv = shlex.split(line, comments=True)
    assert argv[:2] == ["kvpilot", "serve"]
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", argv[2:]).params
    EngineArgs(**{k: params[k] for k in ENGINE_FIELDS}).check()
    return params


def test_catalog_model_on_a_gpu_prints_runnable_forms() -> None:
    lines = _serve_lines(load_model("qwen3-0.6b"), "l4")
    assert len(lines) == 2
    local, dummy = (_parse_serve(line) for line in lines)
    assert local["model"] == "Qwen/Qwen3-0.6B" and "Hugging Face cache" in lines[0]
    assert dummy["model"] == "qwen3-0.6b" and dummy["load_format"] == "dummy"
    assert dummy_hf_config(dummy["model"])["num_hidden_layers"] == 28  # the dummy loader knows the name
    assert local["max_model_len"] == dummy["max_model_len"] == 40960 and local["gpu_memory_utilization"] == 0.9


def test_gguf_and_hf_directory_are_served_by_path(embedded_model: LoadedModel, gguf_path: Path,
                                                  tmp_path: Path) -> None:
    (line,) = _serve_lines(embedded_model, "cpu")
    params = _parse_serve(line)
    assert params["model"] == str(gguf_path) and params["kv_cache_memory"] == "2GiB"
    hf_dir = tmp_path / "SmolLM2"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(get_hf_config("smollm2-135m")))
    (config_only,) = _serve_lines(load_model(str(hf_dir)), "l4")
    assert _parse_serve(config_only)["load_format"] == "dummy"  # no weights there: the shapes with random ones
    (hf_dir / "model.safetensors").write_bytes(b"")
    (with_weights,) = _serve_lines(load_model(str(hf_dir)), "l4")
    assert _parse_serve(with_weights)["model"] == str(hf_dir)


def test_a_bad_flag_would_be_caught() -> None:
    with pytest.raises(Exception, match="No such option: --max-num-seqz"):
        _parse_serve("kvpilot serve --model x --max-num-seqz 3")
    with pytest.raises(Exception, match="gpu_memory_utilization must be in"):
        _parse_serve("kvpilot serve --model x --gpu-memory-utilization 1.5")


def _flag_lines(model: LoadedModel, gpu: str) -> tuple[list[str], bool]:
    """The printed flag lines, and whether the plan runs on one device (kvpilot lines are printed only then)."""
    console = Console(record=True, width=500)
    report = build_report(model, parse_device_arg(gpu), FitInputs())
    render_report(report, console)
    flags = report.flags
    one_device = flags is not None and flags.tensor_parallel_size * flags.pipeline_parallel_size == 1
    return [line for line in console.export_text().splitlines() if line.startswith(("kvpilot serve ", "# no "))], \
        one_device


@pytest.mark.parametrize("name", list_models())
def test_every_catalog_model_gets_only_lines_kvpilot_accepts(name: str) -> None:
    """Issue 45 item 6: walking the catalog, a printed `kvpilot serve` line names a model the engine loads
    (its config passes the registry), and a model the engine refuses gets the reason instead of a line."""
    lines, one_device = _flag_lines(load_model(name), "h200")
    reason = unsupported_reason(dummy_hf_config(name))
    serve_lines = [line for line in lines if line.startswith("kvpilot serve ")]
    if reason is None:
        for line in serve_lines:
            params = _parse_serve(line)
            if params["load_format"] == "dummy":
                assert from_hf_config(dummy_hf_config(params["model"])).num_hidden_layers > 0
    else:
        assert serve_lines == [] and (not one_device or any(reason in line for line in lines))
