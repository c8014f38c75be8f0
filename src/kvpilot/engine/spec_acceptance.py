"""Acceptance estimates: how likely a request's next draft is to be accepted (alpha in spec_cost.py).

A verification of k drafts with a accepted tried a + 1 drafts if one was rejected (a < k), else a, and
accepted a: alpha is accepted / tried, over decayed counts. A request starts from the engine-wide estimate
(PRIOR_TRIALS pseudo-trials of it) and moves to its own as it verifies. A request that gets no drafts
(alpha too low for the price) forgets a little each step it is passed over, drifting back to the engine's
estimate, so one that starts copying later gets tried again.
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_ALPHA = 0.5  # the engine-wide estimate before any verification
ENGINE_PRIOR_TRIALS = 4.0
PRIOR_TRIALS = 2.0  # weight of the engine-wide estimate in a request's
REQUEST_MEMORY = 0.9  # a request's counts decay by this per verification: recent drafts count most
ENGINE_MEMORY = 0.99
PASSED_OVER_MEMORY = 0.95  # per step a request is not given drafts


@dataclass
class AcceptanceCounts:
    """Decayed counts of drafts accepted and tried. Invariant: 0 <= accepted <= tried."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, num_drafts: int, num_accepted: int, memory: float) -> None:
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = memory * self.accepted + num_accepted
        self.tried = memory * self.tried + tried

    def rate(self, prior: float, prior_trials: float) -> float:
        return (self.accepted + prior * prior_trials) / (self.tried + prior_trials)


class AcceptanceTracker:
    """Per-request and engine-wide acceptance. Invariant: holds requests recorded or asked about and not
    forgotten."""

    def __init__(self) -> None:
        self.engine = AcceptanceCounts()
        self._requests: dict[str, AcceptanceCounts] = {}

    @property
    def engine_alpha(self) -> float:
        return self.engine.rate(INITIAL_ALPHA, ENGINE_PRIOR_TRIALS)

    def alpha(self, request_id: str) -> float:
        counts = self._requests.get(request_id)
        prior = self.engine_alpha
        return prior if counts is None else counts.rate(prior, PRIOR_TRIALS)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of num_drafts drafts of which the target accepted the first num_accepted."""
        counts = self._requests.get(request_id)
        if counts is None:
            counts = self._requests[request_id] = AcceptanceCounts()
        counts.add(num_drafts, num_accepted, REQUEST_MEMORY)
        self.engine.add(num_drafts, num_accepted, ENGINE_MEMORY)

    def passed_over(self, request_id: str) -> None:
        """The request got no drafts this step (its alpha did not pay): its own evidence fades a little."""
        counts = self._requests.get(request_id)
        if counts is not None:
            counts.accepted *= PASSED_OVER_MEMORY
            counts.tried *= PASSED_OVER_MEMORY

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
