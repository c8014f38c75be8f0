"""`kvpilot bench` through its typer command: help text, every dataset, bad input without tracebacks."""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpilot.bench.cli import bench_command
from tests.doubles.scripted_process import ScriptedProcess, free_port
from tests.doubles.scripted_server import Behavior

app = typer.Typer()
app.command("bench")(bench_command)
runner = CliRunner()
FAST = ["--num-requests", "6", "--concurrency", "2", "--output-len", "3", "--input-len", "8",
        "--no-progress", "--scrape-interval", "0.1"]


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


def test_help_explains_every_flag() -> None:
    code, text = invoke("--help")
    assert code == 0
    flags = [name.replace("_", "-") for name in inspect.signature(bench_command).parameters]
    missing = [f for f in flags if f"--{f}" not in text]
    assert missing == []
    for name, hint in typing.get_type_hints(bench_command, include_extras=True).items():
        if name != "return":
            info = hint.__metadata__[0] if hasattr(hint, "__metadata__") else None
            assert info is not None and len(info.help or "") > 10, f"--{name} has no help"


@pytest.mark.parametrize("dataset", ["random", "shared-prefix", "long-short", "multi-turn", "jsonl", "trace"])
def test_every_dataset_runs(scripted: ScriptedProcess, tmp_path: Path, dataset: str) -> None:
    scripted.set_script(Behavior(ttft_s=0.005, itl_s=0.002))
    extra: list[str] = ["--endpoint", "chat"] if dataset == "multi-turn" else []
    if dataset in ("jsonl", "trace"):
        path = tmp_path / "data.jsonl"
        path.write_text("\n".join(json.dumps({"timestamp": i * 0.01, "prompt": f"hello {i}"}) for i in range(6)))
        extra += ["--dataset-path", str(path)]
    if dataset == "long-short":
        extra += ["--long-input-len", "40", "--long-fraction", "0.5"]
    if dataset == "shared-prefix":
        extra += ["--prefix-len", "4", "--num-prefixes", "2", "--num-suffixes", "3"]
    out = tmp_path / "r.json"
    code, text = invoke("--base-url", scripted.base_url, "--dataset", dataset, *FAST, *extra, "--output", str(out))
    assert code == 0, text
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert doc["config"]["dataset"]["kind"] == dataset
    assert run["aggregates"]["num_ok"] == 6 and "Latency (ms)" in text


def test_errors_are_summarised_without_traceback(scripted: ScriptedProcess, tmp_path: Path) -> None:
    scripted.set_script(Behavior(ttft_s=0.005, itl_s=0.002), Behavior(status=429, retry_after_s=1),
                        Behavior(ttft_s=0.005, itl_s=0.002, die_after_tokens=1),
                        Behavior(ttft_s=0.005, itl_s=0.002, malformed_after_tokens=1))
    code, text = invoke("--base-url", scripted.base_url, *FAST, "--html", str(tmp_path / "r.html"),
                        "--csv", str(tmp_path / "r.csv"))
    assert code == 0 and "Traceback" not in text
    for kind in ("http_429", "stream_incomplete", "malformed_sse"):
        assert f"errors: {kind}" in text
    assert (tmp_path / "r.html").stat().st_size > 0 and (tmp_path / "r.csv").exists()


def test_kvpilot_bench_html_carries_the_doctor_section(scripted: ScriptedProcess, tmp_path: Path) -> None:
    """kvpilot.cli wires the doctor's report section into `kvpilot bench`; bench's own command has none."""
    from kvpilot.cli import app as kvpilot_app  # noqa: PLC0415

    scripted.set_script(Behavior(ttft_s=0.005, itl_s=0.002))
    wired, plain = tmp_path / "wired.html", tmp_path / "plain.html"
    result = runner.invoke(kvpilot_app, ["bench", "--base-url", scripted.base_url, *FAST, "--html", str(wired)])
    assert result.exit_code == 0, result.output
    assert wired.read_text().count('id="kvpilot-doctor"') == 1
    code, text = invoke("--base-url", scripted.base_url, *FAST, "--html", str(plain))
    assert code == 0, text
    assert 'id="kvpilot-doctor"' not in plain.read_text()


def test_url_is_another_name_for_base_url(scripted: ScriptedProcess, tmp_path: Path) -> None:
    """`kvpilot doctor --url` and `kvpilot bench --url` name a server the same way."""
    scripted.set_script(Behavior(ttft_s=0.005, itl_s=0.002))
    out = tmp_path / "r.json"
    code, text = invoke("--url", scripted.base_url, *FAST, "--output", str(out))
    assert code == 0, text
    assert json.loads(out.read_text())["runs"][0]["aggregates"]["num_ok"] == 6


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, text = invoke("--base-url", url, *FAST)
    assert code == 2 and "pass --model" in text and "Traceback" not in text
    code, text = invoke("--base-url", url, "--model", "m", *FAST)
    assert code == 1 and "errors: connect_error" in text and "every request failed" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--slo", "ttft=fast"], "bad SLO"), (["--dataset", "nope"], "--dataset"),
    (["--dataset", "jsonl"], "--dataset-path"), (["--request-rate", "0"], "--request-rate"),
    (["--endpoint", "embeddings"], "--endpoint"), (["--sweep", "--duration", "5"], "--num-requests"),
    (["--html", "r.html", "--html-plotlyjs", "local"], "'local': use one of directory")])
def test_bad_options_say_what_to_do(scripted: ScriptedProcess, args: list[str], message: str) -> None:
    count = [] if "--duration" in args else ["--num-requests", "1"]
    code, text = invoke("--base-url", scripted.base_url, "--model", "m", *count, *args)
    assert code == 2 and message in text and "Traceback" not in text


def test_dataset_help_lists_every_dataset() -> None:
    from kvpilot.bench.cli_options import DATASETS_HELP  # noqa: PLC0415
    from kvpilot.bench.datasets import DATASET_KINDS  # noqa: PLC0415

    assert DATASETS_HELP == ", ".join(DATASET_KINDS)
