"""Load shape: closed loop (``--concurrency``) or open loop (``--request-rate``), and how long."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.bench.arrivals import ArrivalProcess, LoadShapeError


@dataclass(frozen=True)
class LoadShape:
    """One run's load.

    Closed loop when ``concurrency`` is set: that many workers, each sending its next request as soon
    as the previous finished. Otherwise open loop at ``request_rate`` (inf = all at once), optionally
    capped by ``max_concurrency`` client slots; time waiting for a slot is recorded as queue wait.
    The run stops after ``num_requests`` requests or ``duration_s`` seconds, whichever comes first
    (at least one must be set). ``num_warmup`` requests run first and are not measured.
    """

    concurrency: int | None = None
    request_rate: float = math.inf
    arrival: ArrivalProcess = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    num_warmup: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise LoadShapeError("--concurrency must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadShapeError("--max-concurrency must be >= 1")
        if self.num_requests is None and self.duration_s is None:
            raise LoadShapeError("give --num-requests or --duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise LoadShapeError("--num-requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise LoadShapeError("--duration must be > 0")
        if not self.closed_loop and math.isinf(self.request_rate) and self.num_requests is None:
            raise LoadShapeError("--duration alone at an infinite --request-rate would send without end: "
                                 "add --num-requests, a finite --request-rate, or --concurrency")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise LoadShapeError("--request-rate and --burstiness must be > 0")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    def label(self) -> str:
        if self.closed_loop:
            return f"concurrency={self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        cap = f", max_concurrency={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={rate}{cap}"
