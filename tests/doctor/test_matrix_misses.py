"""The fault-matrix cells the doctor got wrong (docs/doctor.md, "The kvpilot column"), staged as the inputs the
doctor saw there: a client whose own stalls are most of the latency (slow-client), a pool too small for the
traffic's shared prefixes (tiny-kv-pool), another user's long prompts prefilled in one step (long-prompts), and
returning multi-turn sessions whose prefixes the pool evicted with no offload tier (issue #49 item 4)."""

from __future__ import annotations

import random
from pathlib import Path

from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.inputs import load_inputs
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write


def _ids(report: DoctorReport) -> list[tuple[str, str]]:
    return [(f.rule_id, f.severity.value) for f in report.findings]


def _stalls(stall_ms: float, seconds: float) -> list[tuple[float, float]]:
    """Event-loop lag every 10 ms with a ``stall_ms`` stall every half second."""
    return [(k * 0.01, stall_ms if k % 50 == 0 else 0.4) for k in range(int(seconds * 100))]


def _slow_client(tmp: Path, stall_ms: float, stalls: tuple[float, float]) -> list[str]:
    """A healthy server on 127.0.0.1 probed by a client that stalls ``stall_ms`` every half second: each first
    token waits in the socket through ``stalls`` (low, high) of them (client TTFT = server TTFT + that)."""
    rng = random.Random(11)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prefill=jitter(rng, 40), num_out=8,
                                               net=2.0 + stall_ms * rng.uniform(*stalls)))
    return [write(tmp / f"slow-client-{stall_ms:g}.json",
                  [run("ramp-4", recs, loop_lag=_stalls(stall_ms, 8), metrics=samples(4, running=4, waiting=0,
                                                                                      kv=0.1))])]


def test_a_client_whose_stalls_are_most_of_the_latency_leads(tmp_path: Path) -> None:
    """The slow-client cell: 370 ms stalls beside 45 ms server TTFTs; the GIL-bound client reads most first
    tokens one or two stalls late, so its median TTFT (~870 ms) is more than twice the lag, which made the lag a
    LOW caveat "too small to explain it". But the time clients saw beyond the server's own TTFT is most of their
    p90 TTFT and the lag covers it: client-overload is the headline, with that share. A 15 ms stall on the same
    healthy server stays a caveat."""
    report = diagnose(load_inputs(_slow_client(tmp_path, 370.0, (1.5, 3.0))))
    first = report.findings[0]
    assert (first.rule_id, first.severity.value) == ("client-overload", "high"), _ids(report)
    assert first.explains is not None and first.explains.share > 0.5 and "beyond the server" in first.explains.of
    mild = diagnose(load_inputs(_slow_client(tmp_path, 15.0, (0.0, 1.0))))
    assert all(f.severity.value == "low" for f in mild.findings), _ids(mild)
