"""Split latency into its stages (medians), the first thing a careful engineer looks at.

From kvpilot's per-request server timings when present; otherwise from the server's histogram means
(vLLM names) for the server-side stages, and the client's own TTFT / TPOT / E2E.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.doctor.inputs import DoctorInputs, RunData
from kvpilot.doctor.signals import median


@dataclass(frozen=True)
class LatencySplit:
    """Median milliseconds per stage at one load level; None where nothing measured it.

    ``source`` is "server timings" (kvpilot's per-request field), "metrics means" (histogram
    sum/count from /metrics) or "client only"."""

    label: str
    in_flight: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    network_ms: float | None
    queue_ms: float | None
    tokenize_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    server_ttft_ms: float | None
    source: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def split_run(run: RunData) -> LatencySplit:
    ok, srv = run.ok, run.with_server
    client = {"ttft_ms": median(r.ttft_ms for r in ok), "tpot_ms": median(r.tpot_ms for r in ok),
              "e2e_ms": median(r.e2e_ms for r in ok)}
    if not srv:
        return LatencySplit(run.label, run.in_flight, **client, network_ms=None, queue_ms=None,
                            tokenize_ms=None, prefill_ms=None, decode_ms=None, server_ttft_ms=None,
                            source="client only")
    return LatencySplit(
        run.label, run.in_flight, **client,
        network_ms=median((r.ttft_ms or 0.0) - r.server.ttft_ms for r in srv if r.server),
        queue_ms=median(r.server.queue_ms for r in srv if r.server),
        tokenize_ms=median(r.server.tokenize_ms for r in srv if r.server),
        prefill_ms=median(r.server.prefill_ms for r in srv if r.server),
        decode_ms=median(r.server.decode_ms for r in srv if r.server),
        server_ttft_ms=median(r.server.ttft_ms for r in srv if r.server),
        source="server timings")


def split_from_metrics(inputs: DoctorInputs) -> LatencySplit | None:
    """The server's own view from a metrics file (means; the histograms have no per-request rows)."""
    snap = inputs.metrics
    if snap is None or not snap.histograms:
        return None
    return LatencySplit("metrics file", None, ttft_ms=None, tpot_ms=snap.mean_ms("itl"),
                        e2e_ms=snap.mean_ms("e2e"), network_ms=None, queue_ms=snap.mean_ms("queue"),
                        tokenize_ms=snap.mean_ms("tokenize"), prefill_ms=snap.mean_ms("prefill"),
                        decode_ms=snap.mean_ms("decode"), server_ttft_ms=snap.mean_ms("ttft"),
                        source="metrics means")


def latency_splits(inputs: DoctorInputs) -> list[LatencySplit]:
    """One split per run (lowest load first), then the metrics file's if it has histograms."""
    splits = [split_run(run) for run in inputs.runs]
    from_metrics = split_from_metrics(inputs)
    return splits + ([from_metrics] if from_metrics is not None else [])
