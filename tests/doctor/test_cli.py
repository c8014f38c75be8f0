"""`kvpilot doctor` as users call it: exit codes 0 / 1 / 2, --json, --html, one-line errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import typer
from typer.testing import CliRunner, Result

from kvpilot.doctor.cli import doctor_command
from tests.doctor.scenarios import SCENARIOS, healthy

app = typer.Typer()
app.command()(doctor_command)
FIX = Path(__file__).parent / "fixtures"


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def test_healthy_exits_0(tmp_path: Path) -> None:
    (path,), _, _, _ = healthy(tmp_path)
    result = _invoke("--from", path)
    assert result.exit_code == 0, result.output
    assert "healthy" in result.output and "Headroom" in result.output


def test_findings_exit_1_with_json(tmp_path: Path) -> None:
    (path,), _, _, _ = SCENARIOS["queueing"](tmp_path)
    result = _invoke("--from", path, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["healthy"] is False and doc["exit_code"] == 1
    top = doc["findings"][0]
    assert top["rule_id"] == "queueing" and top["severity"] == "high"
    assert top["evidence"] and top["fixes"][0]["kvpilot"].startswith("--max-num-seqs")
    assert doc["latency_split_ms"][0]["source"] == "server timings"


def test_several_results_and_roofline(tmp_path: Path) -> None:
    paths, _, _, _ = SCENARIOS["static-batching"](tmp_path)
    result = _invoke("--from", paths[0], "--from", paths[1], "--model", "llama-3.1-8b", "--gpu", "h100-sxm",
                     "--json")
    doc = json.loads(result.stdout)
    assert [s["label"] for s in doc["latency_split_ms"]] == ["concurrency=1", "concurrency=8"]
    assert doc["roofline"]["gpu"] == "h100-sxm" and doc["findings"][0]["rule_id"] == "static-batching"


def test_console_output_names_fixes_for_the_running_engine_and_kvpilot() -> None:
    """A vLLM metrics file: the fixes come as vLLM's flags first (the engine that runs), then kvpilot's."""
    result = _invoke("--metrics-file", str(FIX / "vllm_v1_pressure.txt"))
    assert result.exit_code == 1
    assert "kv-cache-pressure" in result.output and "kvpilot:" in result.output
    assert "vLLM (running):" in result.output and "engine: vLLM" in result.output


def test_html_fragment_written(tmp_path: Path) -> None:
    out = tmp_path / "doctor.html"
    result = _invoke("--metrics-file", str(FIX / "vllm_v1_pressure.txt"), "--html", str(out))
    assert result.exit_code == 1
    assert out.read_text().startswith('<section id="kvpilot-doctor">')


def _assert_unusable(result: Result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output


def test_unusable_inputs_exit_2_with_one_line(tmp_path: Path) -> None:
    _assert_unusable(_invoke(), "nothing to diagnose")
    _assert_unusable(_invoke("--from", str(tmp_path / "missing.json")), "cannot read bench result")
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"schema_version": 0}))
    _assert_unusable(_invoke("--from", str(bad)), "schema_version")
    text = tmp_path / "m.txt"
    text.write_text("hello world\n")
    _assert_unusable(_invoke("--metrics-file", str(text)), "m.txt")
    (path,), _, _, _ = healthy(tmp_path)
    _assert_unusable(_invoke("--from", path, "--model", "lama-3.1-8b"), "unknown model")


def test_url_unreachable_or_mixed_with_files_exits_2(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    _assert_unusable(_invoke("--url", url, "--quick"), "cannot probe")
    (path,), _, _, _ = healthy(tmp_path)
    _assert_unusable(_invoke("--url", url, "--from", path), "use one or the other")
    _assert_unusable(_invoke("--from", path, "--quick"), "go with --url")


def test_serve_that_cannot_start_is_one_line_exit_2() -> None:
    result = _invoke("--serve", "definitely-not-a-server-xyz --port 1", "--quick")
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot run 'definitely-not-a-server-xyz'" in lines[0], result.output


def test_verify_without_serve_and_serve_with_url_are_refused() -> None:
    assert "--verify needs --serve" in _invoke("--verify").output
    result = _invoke("--serve", "kvpilot serve", "--url", "http://127.0.0.1:1")
    assert result.exit_code == 2 and "leave out --url" in result.output


def test_slo_turns_a_healthy_run_into_a_finding_and_bad_goals_exit_2(tmp_path: Path) -> None:
    (path,), _, _, _ = healthy(tmp_path)
    assert _invoke("--from", path, "--workload", "chat").exit_code == 0  # the healthy run meets chat's SLOs
    strict = _invoke("--from", path, "--slo", "tpot=1ms", "--json")
    assert strict.exit_code == 1, strict.output
    doc = json.loads(strict.stdout)
    assert doc["findings"][0]["rule_id"] == "decode-bound" and "even at" in doc["findings"][0]["summary"]
    assert doc["slos_ms"] == {"tpot": 1.0} and any(h.startswith("SLOs (tpot <= 1 ms)") for h in doc["headroom"])
    for args, message in ((("--workload", "gaming"), "use one of chat, agent, batch"),
                          (("--slo", "latency=fast"), "--slo: bad SLO")):
        result = _invoke("--from", path, *args)
        assert result.exit_code == 2 and message in result.output


def test_phase_seconds_outside_its_range_is_refused() -> None:
    _assert_unusable(_invoke("--url", "http://127.0.0.1:9", "--phase-seconds", "0.5"), "--phase-seconds")
    _assert_unusable(_invoke("--from", "x.json", "--phase-seconds", "4"), "go with --url")


def test_phase_seconds_sets_every_phase_of_the_chosen_probe() -> None:
    from kvpilot.doctor.cli import _limits
    from kvpilot.doctor.probe_plan import QUICK

    limits = _limits(True, 4, 4.0)
    assert limits.phase_s == 4.0 and limits.ramp == (1, 4) and limits.max_requests == QUICK.max_requests
