"""Grammar-constrained decoding (structured outputs) in the runner, with llguidance.

Each persistent row whose request has `structured_outputs` holds an llguidance matcher: created when the row
is added (a resumed request replays its output tokens into a fresh matcher), asked for the allowed-token
bitmask before every sample, fed the sampled token right after it. Once the grammar is complete the
matcher allows only EOS, so the request ends with finish_reason "stop" by the scheduler's one EOS rule.

The matcher work runs in MaskWorkers' threads (grammar_masks.py): a row's next mask is computed from the
moment its token is sampled until the next step needs it. `record` reads the constrained rows' sampled ids to
the host at once, so the work can start: correct under async scheduling too (where the engine reads results
one step late), at the price of a device sync in the steps that hold a constrained row.

A grammar that fails here (it does not compile, rejects a token, hits an llguidance limit, or one token's work
takes more than GrammarLimits.max_mask_ms of CPU) fails its request alone: the row goes on unconstrained (its
tokens are discarded: the engine finishes the request with reason "error" when it reads this step's result,
`take_failures`), and nothing raises out of the step, so the requests batched with it are not rolled back.
Rows without a grammar cost one integer test per step.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np
import torch

from kvpilot.model.grammar_compiler import GrammarCompiler
from kvpilot.model.grammar_masks import MaskOutcome, MaskWorkers
from kvpilot.sampling_params import SamplingParams
from kvpilot.structured_outputs import StructuredOutputsError
from kvpilot.structured_outputs.limits import explain, over_budget


class GrammarState:
    """Per-row matchers. Invariants: matchers[r] is not None iff row r's request has structured_outputs and its
    grammar has not failed; it has consumed exactly the row's output tokens sampled so far (up to the
    grammar's end) once jobs[r], the work submitted for its next sample, is done; failed requests are reported
    once, by take_failures."""

    def __init__(self, max_rows: int, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler, self.device, self.limits = compiler, device, compiler.limits
        self.matchers: list[Any] = [None] * max_rows
        self.jobs: list[Future[MaskOutcome] | None] = [None] * max_rows
        self._request_ids: list[str | None] = [None] * max_rows
        self.num_active = 0
        self._words = (compiler.vocab_size + 31) // 32
        self._workers = MaskWorkers(max_rows)
        self._failures: dict[str, str] = {}  # request id -> why its grammar failed, until taken
        self._shifts: torch.Tensor | None = None

    def add(self, row: int, request_id: str, params: SamplingParams, output_ids: Sequence[int]) -> None:
        """Holds a matcher for the row's request (its output so far replayed) and starts its first mask; a
        grammar that cannot be built fails the request."""
        self.remove(row)
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            matcher = self.compiler.matcher(spec)
        except StructuredOutputsError as exc:
            self._failures[request_id] = str(exc)
            return
        self.matchers[row], self._request_ids[row] = matcher, request_id
        self.num_active += 1
        self.jobs[row] = self._workers.submit(matcher, output_ids, self._words)

    def remove(self, row: int) -> None:
        if self.matchers[row] is not None:
            self.matchers[row] = self.jobs[row] = self._request_ids[row] = None
            self.num_active -= 1

    def take_failures(self) -> dict[str, str]:
        """Request id -> why its grammar failed, for the requests failed since the last call."""
        failures, self._failures = self._failures, {}
        return failures

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """logits [N, vocab] of persistent `rows` -> disallowed tokens of constrained rows set to -inf (rows
        whose grammar fails now are left unconstrained, and reported)."""
        which = self._constrained(rows)
        if not which:
            return logits
        bitmask = np.stack([self._mask(int(rows[i])) for i in which])
        allowed = self._unpack(torch.from_numpy(bitmask).to(logits.device), logits.shape[1])
        index = torch.tensor(which, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def _mask(self, row: int) -> np.ndarray:
        """The row's next mask (waits for its job); all tokens allowed if its grammar failed."""
        job = self.jobs[row]
        if job is None:  # every matcher gets a job when added and after each token: none is missing
            job = self._workers.submit(self.matchers[row], (), self._words)
        outcome = job.result()
        self.jobs[row] = None
        if outcome.error:
            self._fail(row, f"structured_outputs: the grammar failed: {explain(outcome.error, self.limits)}")
        elif outcome.cpu_seconds > self.limits.max_mask_s:
            self._fail(row, f"structured_outputs: {over_budget(outcome.cpu_seconds, self.limits)}")
        else:
            return outcome.mask
        return np.full(self._words, -1, dtype=np.int32)

    def _fail(self, row: int, message: str) -> None:
        request_id = self._request_ids[row]
        assert request_id is not None  # a row with a matcher has its request id
        self._failures[request_id] = message
        self.remove(row)

    def _constrained(self, rows: np.ndarray) -> list[int]:
        """Positions in `rows` whose row holds a matcher (none at all costs one integer test)."""
        if not self.num_active:
            return []
        return [i for i, row in enumerate(rows.tolist()) if self.matchers[row] is not None]

    def _unpack(self, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """int32 [k, words] (bit j of word w: token 32w + j) -> bool [k, vocab_size]."""
        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask[:, :, None] >> self._shifts) & 1
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Starts each constrained row's work for its next sample: feeding it its just-sampled token (reads
        those ids to the host)."""
        which = self._constrained(rows)
        if not which:
            return
        sampled = token_ids[torch.tensor(which, device=token_ids.device)].tolist()
        for i, token_id in zip(which, sampled):
            row = int(rows[i])
            self.jobs[row] = self._workers.submit(self.matchers[row], (token_id,), self._words)
