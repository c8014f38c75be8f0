"""benchmarks/gpu_throughput.py: `--smoke` runs on CPU (tiny dummy models, float32), and its pure helpers."""

from __future__ import annotations

import json
import sys

import pytest

import gpu_throughput
from gpu_throughput import CHECK_TOKENS, SMOKE_ROWS, SMOKE_SHAPE, Result, format_table, make_requests, model_source


@pytest.mark.slow  # HF transformers beside kvpilot (a few seconds on a quiet box)
def test_smoke_runs_on_cpu_and_agrees_with_hf(tmp_path, monkeypatch, capsys):
    """One tiny row end to end: kvpilot's tokens and HF transformers' on the same dummy weights."""
    output = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py", "--smoke", "--rows", "qwen3-b1", "--output", str(output)])
    gpu_throughput.main()
    document = json.loads(output.read_text())
    assert document["environment"]["smoke"] and document["environment"]["dtype"] == "float32"
    (result,) = document["results"]
    assert result["key"] == "qwen3-b1" and result["kvpilot"] > 0 and result["hf"] > 0
    assert result["hf_agree"] == CHECK_TOKENS  # float32 on the same weights: token for token
    assert "FAILED" not in capsys.readouterr().out


def test_smoke_models_are_tiny_configs_of_the_catalog_models(tmp_path):
    source, config = model_source("qwen3-0.6b", smoke=True, workdir=tmp_path)
    assert source == str(tmp_path / "qwen3-0.6b" / "config.json")
    assert json.loads((tmp_path / "qwen3-0.6b" / "config.json").read_text()) == config
    assert {k: config[k] for k in SMOKE_SHAPE} == SMOKE_SHAPE and "rope_scaling" not in config
    name, full = model_source("qwen3-0.6b", smoke=False, workdir=tmp_path)
    assert name == "qwen3-0.6b" and full["hidden_size"] != SMOKE_SHAPE["hidden_size"]


def test_smoke_rows_fit_the_tiny_vocabulary_and_are_reproducible():
    for row in SMOKE_ROWS:
        requests = make_requests(row, SMOKE_SHAPE["vocab_size"], seed=0)
        assert len(requests) == row.num_requests and requests == make_requests(row, SMOKE_SHAPE["vocab_size"], 0)
        for prompt, output_len in requests:
            assert row.input_range[0] <= len(prompt) <= row.input_range[1]
            assert row.output_range[0] <= output_len <= row.output_range[1]
            assert all(0 <= t < SMOKE_SHAPE["vocab_size"] for t in prompt)


def test_table_shows_ratio_target_and_agreement():
    rows = [Result("qwen3-b1", "Qwen3 b1", kvpilot=600.0, hf=200.0, target=500.0, ttft=False, seconds=12.0,
                   hf_agree=8),
            Result("llama-ttft", "Llama TTFT", kvpilot=1.2, hf=None, target=1.5, ttft=True, seconds=30.0)]
    lines = format_table(rows).splitlines()
    assert lines[1].split()[-6:] == ["200", "3.00", "500", "1.20x", "12", "8/8"]
    assert "1.200s" in lines[2] and "1.5s" in lines[2] and "1.25x" in lines[2]


@pytest.mark.parametrize("argv", [["--rows", "no-such-row"], ["--smoke", "--rows", "llama-b1"]])
def test_rows_that_select_nothing_print_an_empty_table(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py", *argv])
    gpu_throughput.main()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("row ")
