"""benchmarks/doctor_matrix.py without starting an engine: the fault table (at least ten planted faults and a
healthy server, each naming real doctor rules), every cell's server command on every engine (flags over that
engine's healthy base, each flag one the engine has: kvpilot's own CLI, `llama-server --help` and vLLM's argument
source where those are installed), judging and the confusion table, the verify commands, and the staging the
matrix shares with the doctor's live tests (pinned busy loops, the background load against a scripted server).
The live tests (tests/doctor/test_live_*.py) run several of these faults end to end; `doctor_matrix.py --smoke`
runs two on the real server."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import typer

import doctor_matrix
from peers import fault_matrix as fm
from peers import llamacpp
from peers.vllm_cpu import vllm_venv

from kvpilot.doctor.serve import engine_of, parse_command
from kvpilot.doctor.verify import apply_flags
from tests.doctor.fault_staging import background_load, spinners
from tests.doubles.scripted_server import Behavior, ScriptedServer

RULES_DIR = Path(__file__).resolve().parents[2] / "src" / "kvpilot" / "doctor" / "rules"
CACHE = Path("~/.cache/kvpilot-peers").expanduser()
# the brief's planted causes (issue #51, item 3), each a row of the matrix
REQUIRED = {"too-few-seqs", "tiny-kv-pool", "max-len-over-pool", "prefix-caching-off", "one-slot", "long-prompts",
            "cpu-starvation", "slow-network", "slow-client", "overloaded-queue"}


def rule_ids() -> set[str]:
    return {m for p in RULES_DIR.glob("*.py") for m in re.findall(r'rule_id="([a-z-]+)"', p.read_text())}


def setup(server_cpus: tuple[int, ...] | None = None) -> fm.EngineSetup:
    return fm.EngineSetup(Path("/c"), Path("/m/SmolLM2.Q4_1.gguf"), 2, server_cpus)


@pytest.fixture(autouse=True)
def _llama_server_path(monkeypatch):
    monkeypatch.setattr(llamacpp, "find_llama_server", lambda cache_dir: Path("/b/llama-server"))


def test_the_matrix_plants_ten_faults_and_a_healthy_server_each_named_by_real_rules():
    names = [f.name for f in fm.FAULTS]
    assert len(names) == len(set(names)) and REQUIRED <= set(names)
    assert sum(not f.healthy for f in fm.FAULTS) >= 10 and fm.fault("healthy").healthy
    known = rule_ids()
    assert len(known) > 20
    for fault in fm.FAULTS:
        assert fault.expected <= known, fault.name
        assert set(fault.cells) == set(fm.ENGINES), fault.name
        assert all(cell.na is None or (cell.na and not cell.flags) for cell in fault.cells.values())
    # every engine expresses every required fault: n/a only where a switch does not exist
    assert all(f.cell(e).na is None for f in fm.FAULTS if f.name in REQUIRED for e in fm.ENGINES)
    assert [e for e in fm.ENGINES if fm.fault("no-cont-batching").cell(e).na is None] == ["llamacpp"]
    # the verify bar (5 faults on kvpilot, 3 on vLLM) is reachable: that many live in the server's flags
    assert sum(f.verifiable for f in fm.FAULTS) >= 5
    assert not any(f.verifiable for f in fm.FAULTS if f.outside_server or f.healthy)


@pytest.mark.parametrize("engine", fm.ENGINES)
def test_every_cell_is_the_engine_base_with_exactly_its_flags(engine):
    base = fm.base_spec(engine, setup(), 8123).command
    for fault in fm.FAULTS:
        cell = fault.cell(engine)
        if cell.na:
            with pytest.raises(ValueError, match="n/a"):
                fm.server_spec(engine, fault, setup(), 8123)
            continue
        spec = fm.server_spec(engine, fault, setup(), 8123)
        assert spec.command == apply_flags(base, list(cell.flags)) and spec.port == 8123, fault.name
        assert spec.command[spec.command.index("--port") + 1] == "8123"
    pinned = fm.server_spec(engine, fm.fault("healthy"), setup((0,)), 8123).command
    assert pinned[:3] == ["taskset", "-c", "0"] and pinned[3:] == base


def _flag_names(flags: tuple[str, ...]) -> set[str]:
    return {flag for flag in flags if flag.startswith("--")}


def test_kvpilot_cells_use_flags_of_kvpilot_serve():
    from kvpilot.cli import app

    serve = typer.main.get_command(app).commands["serve"]
    known = {opt for param in serve.params for opt in (*param.opts, *param.secondary_opts)}
    used = set().union(*(_flag_names(f.cell("kvpilot").flags) for f in fm.FAULTS), _flag_names(fm.KVPILOT_BASE))
    assert used and used <= known, used - known


def test_llama_server_cells_use_flags_of_the_built_llama_server():
    used = set().union(*(_flag_names(f.cell("llamacpp").flags) for f in fm.FAULTS), {"--metrics", "--kv-unified"})
    binaries = sorted((CACHE / "llamacpp-build").rglob("llama-server")) if (CACHE / "llamacpp-build").is_dir() else []
    if not binaries:
        pytest.skip("no llama-server built under ~/.cache/kvpilot-peers (benchmarks/peers_cpu.py --install-only)")
    import subprocess

    help_text = subprocess.run([str(binaries[0]), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert [flag for flag in sorted(used) if not llamacpp.has_flag(help_text, flag)] == []


def test_vllm_cells_use_flags_of_the_installed_vllm():
    used = set().union(*(_flag_names(f.cell("vllm").flags) for f in fm.FAULTS))
    sources = sorted(vllm_venv(CACHE).root.glob("lib/python3*/site-packages/vllm/engine/arg_utils.py"))
    if not sources:
        pytest.skip("vLLM's CPU build is not installed under ~/.cache/kvpilot-peers")
    text = sources[0].read_text()
    # BooleanOptionalAction registers --enable-x and makes --no-enable-x from it
    assert [f for f in sorted(used) if f'"{f.replace("--no-", "--", 1)}"' not in text] == []


def test_verify_commands_keep_the_engine_the_doctor_sees_and_a_fixed_port():
    for engine, fault in (("vllm", "one-slot"), ("kvpilot", "tiny-kv-pool")):
        spec = fm.server_spec(engine, fm.fault(fault), setup((0,)), 8124, pin=False)
        argv = parse_command(fm.serve_command_line(spec))
        assert engine_of(argv) == engine and argv[argv.index("--port") + 1] == "8124"
        assert argv[0] == "env" and all(f"{k}={v}" in argv for k, v in spec.env.items())
    vllm = parse_command(fm.serve_command_line(fm.server_spec("vllm", fm.fault("healthy"), setup(), 1)))
    assert vllm[vllm.index("--override-generation-config") + 1] == '{"temperature": 0.0}'


def _doc(*findings: tuple[str, str]) -> dict:
    return {"findings": [{"rule_id": rule, "severity": severity} for rule, severity in findings]}


def test_first_finding_is_the_first_above_low_and_host_causes_are_passed_over_unless_planted():
    doc = _doc(("max-num-seqs-over-kv", "low"), ("cpu-starvation", "high"), ("queueing", "high"))
    assert fm.first_finding(doc) == "cpu-starvation" and fm.first_finding(None) == fm.ERROR
    assert fm.first_finding(_doc(("decode-bound", "low"))) == fm.NONE
    assert fm.first_past_host(doc, fm.fault("one-slot")) == "queueing"
    assert fm.first_past_host(doc, fm.fault("cpu-starvation")) == "cpu-starvation"
    assert fm.is_right(fm.fault("healthy"), fm.NONE) and not fm.is_right(fm.fault("healthy"), "queueing")
    assert fm.is_right(fm.fault("one-slot"), "static-batching") and not fm.is_right(fm.fault("one-slot"), fm.NONE)


def test_confusion_table_counts_first_findings_per_planted_cause():
    rows = [fm.Row(fm.fault("healthy"), [fm.NONE] * 3, [fm.NONE] * 3),
            fm.Row(fm.fault("one-slot"), ["queueing", "cpu-starvation", "queueing"], ["queueing"] * 3),
            fm.Row(fm.fault("prefix-caching-off"), ["prefix-cache-miss", fm.ERROR, "queueing"],
                   ["prefix-cache-miss", fm.ERROR, "queueing"]),
            fm.Row(fm.fault("no-cont-batching"), status="n/a: batches continuously")]
    lines = fm.confusion_lines("kvpilot", rows)
    head = [c.strip() for c in lines[1].split("|")]
    assert head[1:] == ["queueing", "cpu-starvation", "prefix-cache-miss", fm.NONE, fm.ERROR, "right", "past host",
                        "agree"]
    one_slot = [c.strip() for c in next(ln for ln in lines if ln.startswith("one-slot")).split("|")]
    assert one_slot[1:3] == ["2*", "1"] and one_slot[-3:] == ["2/3", "3/3", "2/3"]
    assert [c.strip() for c in lines[3].split("|")][4] == "3*"  # healthy: nothing above LOW, right
    assert "n/a: batches continuously" in next(ln for ln in lines if ln.startswith("no-cont-batching"))
    assert lines[-1].startswith("kvpilot: right in every repeat on 1 of 3 cells run (2 passing over")
    summary = fm.confusion_json(rows)
    assert summary["cells"]["one-slot"] == {"queueing": 2, "cpu-starvation": 1} and summary["right"]["healthy"] == [3, 3]


def test_smoke_and_subsets():
    args = doctor_matrix.parse_args(["--smoke"])
    assert (args.engines, args.faults, args.repeats) == (["kvpilot"], list(fm.SMOKE_FAULTS), 1)
    assert doctor_matrix.probe_flags(args) == ["--phase-seconds", "2", "--max-concurrency", "4"]
    args = doctor_matrix.parse_args(["--engines", "vllm,llamacpp", "--faults", "healthy,slow-client", "--repeats", "3"])
    assert args.engines == ["vllm", "llamacpp"] and args.faults == ["healthy", "slow-client"]
    assert doctor_matrix.probe_flags(args) == []
    for bad in (["--faults", "nope"], ["--engines", "tgi"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            doctor_matrix.parse_args(bad)
    split = doctor_matrix.Placement.of("split")
    assert split.server_cpus and split.client_cpus and not set(split.server_cpus) & set(split.client_cpus)
    assert doctor_matrix.Placement.of("shared").client_prefix() == []


def test_spinners_are_pinned_and_killed():
    with spinners(1, [0]) as pids:
        deadline = time.monotonic() + 5
        while "Name:\ttaskset" in (status := Path(f"/proc/{pids[0]}/status").read_text()) \
                and time.monotonic() < deadline:
            time.sleep(0.02)  # taskset pins itself, then execs the spinner (same pid)
        assert re.search(r"^Cpus_allowed_list:\s*0$", status, re.MULTILINE), status
    time.sleep(0.1)
    assert not Path(f"/proc/{pids[0]}").exists() or "State:\tZ" in Path(f"/proc/{pids[0]}/status").read_text()


def test_background_load_keeps_its_clients_busy_until_stopped():
    with ScriptedServer(Behavior(ttft_s=0.01, itl_s=0.001)) as server:
        stop = threading.Event()
        counts: dict[str, int] = {}
        thread = threading.Thread(target=lambda: counts.update(background_load(server.base_url, 3, 12, 4, 0.0, stop)))
        thread.start()
        time.sleep(0.8)
        stop.set()
        thread.join(10)
    assert counts["ok"] >= 3 and counts["failed"] == 0, counts
    bodies = [r.body for r in server.log]
    assert all(b["max_tokens"] == 4 and b["ignore_eos"] and len(b["prompt"].split()) == 12 for b in bodies)
