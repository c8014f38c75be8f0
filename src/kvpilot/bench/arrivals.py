"""Open-loop arrival schedules: Poisson, gamma (vLLM's ``--burstiness``) or constant spacing."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "constant"]


class LoadShapeError(ValueError):
    """Invalid load-shape options."""


def arrival_times(rate: float, num: int, rng: np.random.Generator, process: ArrivalProcess = "poisson",
                  burstiness: float = 1.0) -> list[float]:
    """``num`` arrival offsets in seconds, starting at the first gap (not at 0), non-decreasing.

    Like vLLM: gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate; burstiness
    1 is Poisson, < 1 burstier, > 1 smoother. ``rate=inf`` sends everything at t=0.
    """
    if rate <= 0 or math.isnan(rate):
        raise LoadShapeError(f"--request-rate must be > 0 (got {rate}); use inf for all at once")
    if burstiness <= 0:
        raise LoadShapeError(f"--burstiness must be > 0 (got {burstiness})")
    if math.isinf(rate):
        return [0.0] * num
    if process == "constant":
        gaps = np.full(num, 1.0 / rate)
    elif process == "poisson":
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    else:
        raise LoadShapeError(f"unknown arrival process '{process}': use poisson or constant")
    return np.cumsum(gaps).tolist()
