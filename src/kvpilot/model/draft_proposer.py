"""DraftModelProposer: speculative decoding's draft-model proposer (speculative_config method "draft_model"), a
speculator.DraftProposer that runs a second, smaller model in the engine-core process on the target's device.

The seam, in two halves: the scheduler (torch-free) asks for drafts through the DraftProposer protocol, and
propose() only reserves the draft's blocks and returns k placeholder ids; the target's ModelRunner, handed the
proposer as its `drafter`, calls fill() with the step's SchedulerOutput.draft_token_ids before it runs the
step, and fill() computes every speculating request's drafts in one batch and writes them into those lists
in place. So the draft runs batched across requests, and the scheduler never waits on a model. This module
owns everything with tensors: the draft's ModelRunner (same loader, same runner code, its own paged KV cache
and, on CUDA, its own decode graphs) and the draft's block allocation, its own, never the KV manager's.
launch/draft_model.py builds it. Placeholders that are never filled (a draft failure) are merely rejected
by verification: the target's output does not depend on the drafts.

Per step: each request catches up on the tokens its draft K/V does not hold (what the target accepted or
emitted since; prefill chunks, all requests' together within max_chunk_tokens a round), the last chunk's
logits give its first draft, then all decode greedily together until each has its k drafts. Draft K/V at
positions the target rejected is overwritten: the next catch-up starts at the first position where the
drafts fed and the request's known tokens differ (its length rolled back).

Invariants: a request's draft K/V is valid for its first `_num_valid` positions, and its blocks cover them;
blocks are held only for requests asked about and not forgotten (evicted, least recently asked first, when
another request needs them, unless proposed for the same step: an evicted request starts again from its first
token). The draft runner's rows
are re-added each step (so a row's tokens are always its request's own known tokens).

model/eagle_proposer.py runs an EAGLE head on this machinery through three hooks: `_known` (the tokens a row
holds), `_run` (one draft step: where the head's hidden inputs are handed over) and `_remember` (what the
draft K/V holds after a fill).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.draft_model")
_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _DraftState:
    """One request in the draft's cache: block_ids, and the tokens its K/V was computed from: the request's
    first num_known tokens (all it had at the last call), then fed_draft_ids (the drafts fed back in)."""

    block_ids: list[int] = field(default_factory=list)
    num_known: int = 0
    fed_draft_ids: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from a draft model (the module docstring). `runner` is the draft's ModelRunner, built with
    the target's max_num_seqs over num_blocks blocks of block_size tokens; catch-ups run in rounds of at most
    max_chunk_tokens tokens (the target's max_num_batched_tokens: no draft step is larger than a target step)."""

    def __init__(self, runner: ModelRunner, max_chunk_tokens: int) -> None:
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        self.runner = runner
        self.max_chunk_tokens = max_chunk_tokens
        self.block_size = runner.block_size
        self._free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}  # in order of last use: the first is evicted first
        self._pending: dict[str, Request] = {}  # proposed since the last fill()
        self._held: list[str] = []  # the requests whose rows the draft runner holds

    @property
    def num_requests(self) -> int:
        return len(self._states)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """max_drafts placeholder ids, filled with the draft's greedy tokens by fill() before the step runs;
        [] when the draft's cache cannot hold the request's tokens and drafts even after evicting every other
        request."""
        if max_drafts < 1:
            return []
        rid = request.request_id
        state = self._states.pop(rid, None) or _DraftState()
        self._states[rid] = state  # now the most recently used
        if not self._reserve(rid, state, request.num_tokens + max_drafts - 1):
            self.forget(rid)
            return []
        self._pending[rid] = request
        return [0] * max_drafts

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free_blocks.extend(reversed(state.block_ids))

    def fill(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Writes the drafts of every request proposed since the last call and scheduled in this step (a key of
        draft_token_ids) into its list, in place; the other proposals are dropped. Called for every step (so
        the pending proposals are always the current step's). A draft failure leaves the placeholders (logged)."""
        if not self._pending:
            return
        requests = [r for rid, r in self._pending.items() if rid in draft_token_ids]
        self._pending.clear()
        if not requests:
            return
        try:
            drafts = self._draft(requests, [len(draft_token_ids[r.request_id]) for r in requests])
        except Exception:  # noqa: BLE001 - drafts are optional: a draft failure must not fail the target's step
            logger.exception("the draft model failed: %d requests verify placeholder drafts this step", len(requests))
            for request in requests:
                self.forget(request.request_id)
            return
        for request, tokens in zip(requests, drafts):
            draft_token_ids[request.request_id][:] = tokens
            self._remember(request, self._states[request.request_id], tokens)

    def _remember(self, request: Request, state: _DraftState, drafts: list[int]) -> None:
        """After a fill: what the request's draft K/V now holds (its known tokens, then all drafts but the last)."""
        state.num_known, state.fed_draft_ids = request.num_tokens, drafts[:-1]

    def _known(self, request: Request) -> list[int]:
        """The tokens the draft runner's row holds for a request (at draft positions 0, 1, ...)."""
        return request.all_token_ids

    def _run(self, output: SchedulerOutput, num_known: dict[str, int]) -> dict[str, int]:
        """One draft step (num_known: each request's count of known tokens, where its drafts start): its
        sampled ids by request."""
        return self.runner.execute_model(output).result().token_ids

    def _reserve(self, request_id: str, state: _DraftState, num_tokens: int) -> bool:
        """Blocks for num_tokens positions, evicting the least recently asked other requests as needed (never
        one proposed for this step: its drafts are still to be computed)."""
        num_needed = -(-num_tokens // self.block_size) - len(state.block_ids)
        while num_needed > len(self._free_blocks):
            victim = next((r for r in self._states if r != request_id and r not in self._pending), None)
            if victim is None:
                return False
            self.forget(victim)
        for _ in range(max(num_needed, 0)):
            state.block_ids.append(self._free_blocks.pop())
        return True

    def _draft(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """The requests' drafts: their catch-ups (the last chunk of each samples its first draft), then decodes
        of all requests still short of their num_drafts, together."""
        ids = [r.request_id for r in requests]
        known = [self._known(r) for r in requests]
        num_known = {rid: len(tokens) for rid, tokens in zip(ids, known)}
        starts = [_num_valid(self._states[rid], tokens) for rid, tokens in zip(ids, known)]
        new = [NewRequestData(rid, list(tokens), [], _GREEDY, list(self._states[rid].block_ids), start)
               for rid, tokens, start in zip(ids, known, starts)]
        dropped, self._held = self._held, ids
        drafts: list[list[int]] = [[] for _ in ids]
        positions = list(starts)
        first = True
        while any(p < len(t) for p, t in zip(positions, known)):  # catch-up rounds
            chunks = self._catch_up_chunks(ids, known, positions)
            output = SchedulerOutput(chunks, new_requests=new, finished_request_ids=dropped) if first else \
                SchedulerOutput(chunks, running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                          for c in chunks])
            first = False
            sampled = self._run(output, num_known)
            for i, rid in enumerate(ids):
                if rid in sampled:
                    drafts[i].append(sampled[rid])
        while True:  # decode rounds: each request's latest draft in, its next draft out
            rows = [i for i in range(len(ids)) if len(drafts[i]) < num_drafts[i]]
            if not rows:
                return drafts
            chunks = [ScheduledChunk(ids[i], len(known[i]) + len(drafts[i]) - 1, 1, True) for i in rows]
            output = SchedulerOutput(chunks, running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                               for c in chunks])
            sampled = self._run(output, num_known)
            for i in rows:
                drafts[i].append(sampled[ids[i]])

    def _catch_up_chunks(self, ids: list[str], known: list[list[int]], positions: list[int]) -> list[ScheduledChunk]:
        """One round's chunks: each request's next piece of its catch-up, within max_chunk_tokens in all (at
        least one token: every round makes progress); `positions` advanced past them."""
        chunks: list[ScheduledChunk] = []
        budget = self.max_chunk_tokens
        for i, rid in enumerate(ids):
            num_tokens = min(len(known[i]) - positions[i], budget)
            if num_tokens <= 0:
                continue
            end = positions[i] + num_tokens
            chunks.append(ScheduledChunk(rid, positions[i], num_tokens, end == len(known[i])))
            positions[i], budget = end, budget - num_tokens
        return chunks


def _num_valid(state: _DraftState, known: list[int]) -> int:
    """How many leading positions of the draft's K/V still hold the request's tokens: its known tokens at the
    last call (a prefix of today's: tokens are only appended) and then the fed drafts the target accepted, at
    most len(known) - 1 (the last known token is always fed again: its logits give the first draft)."""
    valid = min(state.num_known, len(known))
    for draft in state.fed_draft_ids:
        if valid >= len(known) or known[valid] != draft:
            break
        valid += 1
    return min(valid, len(known) - 1)
