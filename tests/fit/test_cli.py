"""`kvpilot fit` end to end through typer: JSON answers, tables, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.fit.cli import fit_command
from kvpilot.fit.fingerprint import cpu_has_fast_bf16
from kvpilot.fit.model_catalog import get_hf_config

app = typer.Typer()
app.command("fit")(fit_command)
app.command("noop")(lambda: None)  # a second command keeps `fit` a subcommand, as in kvpilot.cli


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["fit", *args])
    return result.exit_code, result.stdout, result.stderr


def test_json_answers_for_llama_8b_on_h100() -> None:
    code, out, _ = run("llama-3.1-8b", "--gpu", "h100-sxm", "--json", "--price-per-hour", "2.5")
    assert code == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token_unsplit"] == 131_072
    assert data["model"]["params"]["num_total"] == 8_030_261_248
    assert data["memory"]["fits_workload"] is True
    assert data["memory"]["num_kv_tokens"] == data["memory"]["num_kv_blocks"] * 16
    assert data["flags"]["vllm_args"][:2] == ["--tensor-parallel-size", "1"]
    assert data["roofline"]["decode_single"]["bound"] == "memory bandwidth"
    assert data["roofline"]["cost_per_million_output_tokens"] > 0


def test_cpu_plan_matches_kvpilots_engine_flags() -> None:
    code, out, _ = run("smollm2-135m", "--gpu", "cpu", "--kv-cache-memory", "1GiB", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["memory"]["kv_budget_bytes"] == 2**30
    kv_bytes = 2 if cpu_has_fast_bf16() else 4  # the engine's auto dtype here: bf16 or float32 K/V
    assert data["memory"]["num_kv_blocks"] == 2**30 // (16 * 11_520 * kv_bytes)
    assert data["flags"]["kvpilot_args"][:2] == ["--kv-cache-memory", "1GiB"]


def test_table_output_mentions_the_answers() -> None:
    code, out, _ = run("llama-3.1-70b", "--gpu", "h100-sxm:2")
    assert code == 0
    for text in ("Memory per device", "KV cache", "Roofline", "vllm serve meta-llama/Llama-3.1-70B-Instruct"):
        assert text in out


def test_config_json_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(get_hf_config("qwen3-0.6b")))
    for arg in (str(tmp_path), str(tmp_path / "config.json")):
        code, out, _ = run(arg, "--json")
        assert code == 0
        assert json.loads(out)["model"]["params"]["num_total"] == 596_049_920


def test_compare_gpus_ranks_by_throughput_per_device() -> None:
    code, out, _ = run("llama-3.1-70b", "--compare-gpus", "--json")
    assert code == 0
    rows = json.loads(out)
    rates = [row["tokens_per_s_per_device"] for row in rows]
    assert rates == sorted(rates, reverse=True)
    h100 = next(row for row in rows if row["gpu"] == "h100-sxm")
    assert h100["report"]["group"]["count"] == 2


def test_list_catalog() -> None:
    code, out, _ = run("--list")
    assert code == 0 and "deepseek-ai/DeepSeek-V3" in out and "mi300x" in out


def _one_line_error(args: list[str], expected: str) -> None:
    code, out, err = run(*args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and expected in err


@pytest.mark.parametrize(("args", "expected"), [
    (["lama-3.1-8b"], "Did you mean: llama-3.1-8b"),
    (["llama-3.1-8b", "--gpu", "h10"], "unknown GPU 'h10'"),
    (["llama-3.1-8b", "--gpu", "h100-sxm:3"], "must divide"),
    (["llama-3.1-8b", "--max-model-len", "999999"], "max_position_embeddings"),
    (["llama-3.1-8b", "--input-len", "0"], "--input-len must be a positive integer"),
    (["llama-3.1-8b", "--weight-dtype", "int5"], "unknown weight dtype"),
    (["llama-3.1-8b", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["llama-3.1-8b", "--url", "http://127.0.0.1:1"], "capacity endpoint"),
    (["missing/config.json"], "no such file"),
    (["llama-3.1-8b", "--kv-cache-memory", "lots"], "--kv-cache-memory 'lots' is not a size"),
])
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], expected: str) -> None:
    _one_line_error(args, expected)


def test_malformed_config_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    _one_line_error([str(broken)], "not a readable JSON config")
    broken.write_text(json.dumps({"hidden_size": 64}))
    _one_line_error([str(broken)], "config lacks num_hidden_layers")
    broken.write_text(json.dumps({**get_hf_config("llama-3.1-8b"), "num_key_value_heads": 5}))
    _one_line_error([str(broken)], "does not divide")
