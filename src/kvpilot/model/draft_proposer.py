"""DraftModelProposer: speculative decoding's draft-model proposer (speculative_config method "draft_model"), a
speculator.DraftProposer that runs a second, smaller model in the engine-core process on the target's device.

The seam: the scheduler (torch-free) asks the proposer for drafts through the DraftProposer protocol only;
this module, on the model side, owns everything with tensors: the draft's ModelRunner (same loader, same
runner code, its own paged KV cache and, on CUDA, its own decode graph) and the draft's block allocation,
which is its own and never the KV manager's. launch/draft_model.py builds it and hands it to the Speculator.

Per request asked for drafts: the draft catches up on the tokens it has not computed (the tokens the target
accepted or emitted since, as one prefill chunk), then decodes greedily until it has k drafts. Draft K/V at
positions the target rejected is simply overwritten: the next call starts the catch-up at the first position
where the draft's fed tokens and the request's known tokens differ (its length rolled back).

Invariants: a request's draft K/V is valid for its first `num_valid` positions, and its blocks cover them;
blocks are held only for requests asked about and not forgotten (evicted, least recently asked first, when
another request needs them: an evicted request starts again from its first token). The draft runner holds
at most one request's row at a time (re-added each call, so its token row is always the request's own).
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
    max_num_seqs 1 over num_blocks blocks of block_size tokens; a catch-up runs in chunks of at most
    max_chunk_tokens (the target's max_num_batched_tokens: no draft step is larger than a target step)."""

    def __init__(self, runner: ModelRunner, max_chunk_tokens: int) -> None:
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        self.runner = runner
        self.max_chunk_tokens = max_chunk_tokens
        self.block_size = runner.block_size
        self._free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}  # in order of last use: the first is evicted first
        self._held: str | None = None  # the request whose row the runner holds

    @property
    def num_requests(self) -> int:
        return len(self._states)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to max_drafts greedy drafts after the request's known tokens; [] when the draft's cache cannot
        hold the request's tokens and drafts even after evicting every other request."""
        if max_drafts < 1:
            return []
        rid = request.request_id
        known = request.all_token_ids
        state = self._states.pop(rid, None) or _DraftState()
        self._states[rid] = state  # now the most recently used
        start = _num_valid(state, known)
        if not self._reserve(rid, state, len(known) + max_drafts - 1):
            self.forget(rid)
            return []
        try:
            drafts = self._run(rid, state, known, start, max_drafts)
        except Exception:  # noqa: BLE001 - drafts are optional: a draft failure must not fail the target's step
            logger.exception("the draft model failed for request %r: it decodes without drafts this step", rid)
            self.forget(rid)  # (the runner's row, if it took one, is dropped with the next call's diff)
            return []
        state.num_known, state.fed_draft_ids = len(known), drafts[:-1]
        return drafts

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free_blocks.extend(reversed(state.block_ids))

    def _reserve(self, request_id: str, state: _DraftState, num_tokens: int) -> bool:
        """Blocks for num_tokens positions, evicting the least recently asked other requests as needed."""
        num_needed = -(-num_tokens // self.block_size) - len(state.block_ids)
        while num_needed > len(self._free_blocks):
            victim = next((r for r in self._states if r != request_id), None)
            if victim is None:
                return False
            self.forget(victim)
        for _ in range(max(num_needed, 0)):
            state.block_ids.append(self._free_blocks.pop())
        return True

    def _run(self, request_id: str, state: _DraftState, known: list[int], start: int, num_drafts: int) -> list[int]:
        """The catch-up (known[start:], in chunks; the last samples the first draft), then num_drafts - 1
        decodes of the drafts."""
        dropped = [self._held] if self._held is not None else []
        self._held = request_id
        new = NewRequestData(request_id, list(known), [], _GREEDY, list(state.block_ids), start)
        end = min(start + self.max_chunk_tokens, len(known))
        output = SchedulerOutput([ScheduledChunk(request_id, start, end - start, end == len(known))],
                                 new_requests=[new], finished_request_ids=dropped)
        while True:
            token_ids = self.runner.execute_model(output).result().token_ids
            if end == len(known):
                break
            start, end = end, min(end + self.max_chunk_tokens, len(known))
            output = _running_step(request_id, start, end - start, end == len(known))
        drafts = [token_ids[request_id]]
        for position in range(len(known), len(known) + num_drafts - 1):
            drafts.append(self.runner.execute_model(_running_step(request_id, position, 1, True)
                                                    ).result().token_ids[request_id])
        return drafts


def _running_step(request_id: str, start: int, num_tokens: int, needs_sample: bool) -> SchedulerOutput:
    """A step of the one request the draft runner holds: num_tokens from start (its blocks are all known)."""
    return SchedulerOutput([ScheduledChunk(request_id, start, num_tokens, needs_sample)],
                           running_requests=[RunningRequestData(request_id, [], start)])


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
