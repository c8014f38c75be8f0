"""Boundaries: thresholds are honoured, near misses stay quiet, and a sweep's burst probe is not
mistaken for the deployment's steady state."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.inputs import load_inputs
from kvpilot.doctor.thresholds import Thresholds
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write
from tests.doctor.scenarios import SCENARIOS


def _ids(report: DoctorReport) -> list[str]:
    return [f.rule_id for f in report.findings]


def test_thresholds_are_what_rules_compare_with(tmp_path: Path) -> None:
    inputs = load_inputs(*SCENARIOS["network-overhead"](tmp_path))
    assert _ids(diagnose(inputs))[0] == "network-overhead"
    relaxed = dataclasses.replace(Thresholds(), network_min_ms=500.0)
    assert "network-overhead" not in _ids(diagnose(inputs, relaxed))


def test_short_queue_is_not_a_finding(tmp_path: Path) -> None:
    """15 ms of queue against a 55 ms TTFT: below both the share and the absolute threshold."""
    rng = random.Random(3)
    recs = closed_loop(30, 4, lambda i, t: req(i, t, queue=jitter(rng, 15), prefill=jitter(rng, 40)))
    path = write(tmp_path / "r.json", [run("c4", recs, metrics=samples(2, running=4, waiting=0.3, kv=0.4))])
    assert "queueing" not in _ids(diagnose(load_inputs([path])))


def test_burst_probe_of_a_sweep_does_not_count_as_queueing(tmp_path: Path) -> None:
    """A sweep's max-throughput run sends everything at once: its queue is by construction."""
    rng = random.Random(4)
    steady = closed_loop(20, 2, lambda i, t: req(i, t, prefill=jitter(rng, 40)))
    burst = [req(i, 0.001 * i, queue=400.0 * (i // 8), prefill=40.0) for i in range(40)]
    path = write(tmp_path / "sweep.json", [run("concurrency=2", steady, concurrency=2),
                                           run("max-throughput", burst, concurrency=None)])
    report = diagnose(load_inputs([path]))
    assert "queueing" not in _ids(report)
    alone = write(tmp_path / "burst.json", [run("max-throughput", burst, concurrency=None)])
    assert "queueing" in _ids(diagnose(load_inputs([alone])))  # nothing else measured: report it


def test_decode_growth_across_result_files(tmp_path: Path) -> None:
    """TPOT 10 ms alone, 35 ms at 16 in flight (throughput still grows): decode-bound, not static."""
    rng = random.Random(5)
    one = closed_loop(12, 1, lambda i, t: req(i, t, itl=jitter(rng, 10, 0.05)))
    many = closed_loop(48, 16, lambda i, t: req(i, t, itl=jitter(rng, 35, 0.05)))
    paths = [write(tmp_path / "a.json", [run("c1", one, concurrency=1)]),
             write(tmp_path / "b.json", [run("c16", many, concurrency=16)])]
    ids = _ids(diagnose(load_inputs(paths)))
    assert ids[0] == "decode-bound" and "static-batching" not in ids


def test_waiting_for_the_step_in_progress_is_not_queueing(tmp_path: Path) -> None:
    """A CPU server at 4 clients (measured shape): steps of ~160 ms, a new request waits ~1.7 steps for
    the step in progress and its own admission, 55% of its TTFT. Twice as long a wait is queueing."""
    rng = random.Random(6)

    def at(queue_ms: float) -> list:
        return closed_loop(24, 4, lambda i, t: req(i, t, queue=jitter(rng, queue_ms), prefill=jitter(rng, 220),
                                                    itl=jitter(rng, 160, 0.05), num_out=8))

    step_wait = write(tmp_path / "a.json", [run("c4", at(280.0), metrics=samples(2, running=4, waiting=0.3, kv=0.2))])
    assert "queueing" not in _ids(diagnose(load_inputs([step_wait])))
    waits = write(tmp_path / "b.json", [run("c4", at(560.0), metrics=samples(2, running=4, waiting=1.5, kv=0.2))])
    assert "queueing" in _ids(diagnose(load_inputs([waits])))


def test_headroom_names_the_saturation_knee(tmp_path: Path) -> None:
    """Throughput rises 1 -> 4 streams and stays flat at 16 (each step 4x slower): the knee is 4."""
    rng = random.Random(9)
    loads = ((1, 10.0, 12), (4, 12.0, 24), (16, 60.0, 48))
    paths = [write(tmp_path / f"c{c}.json", [run(f"c{c}", closed_loop(n, c, lambda i, t, itl=itl: req(
        i, t, itl=jitter(rng, itl, 0.02), num_out=16)), concurrency=c)]) for c, itl, n in loads]
    headroom = diagnose(load_inputs(paths)).headroom
    knee = next(line for line in headroom if line.startswith("saturation knee"))
    assert knee.startswith("saturation knee at 4 in flight") and "throughput stopped rising" in knee
    rising = diagnose(load_inputs(paths[:2])).headroom  # two loads make no curve yet
    assert not any("knee" in line for line in rising)
