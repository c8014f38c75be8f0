"""EagleProposer: speculative decoding's EAGLE proposer (speculative_config method "eagle" or "eagle3"): the
draft-model proposer's machinery (model/draft_proposer.py: placeholders from propose(), drafts computed in
fill() before the target's step, the head's own paged KV cache, catch-up rounds then one batched decode round
per draft position) with an EAGLE head (model/models/eagle.py) in the draft runner instead of a model.

What differs from a draft model:
- Features. The target's runner hands each step's hidden states to observe() (for EAGLE-3 the inputs of its
  aux layers, concatenated): kept per request by position, until the head has consumed them. A later chunk of
  the same request from position p replaces what was kept from p on (the rows of rejected drafts, a
  preempted request's recomputation).
- Shifted tokens. Head position p reads [embedding of token p + 1, feature at p]: the draft runner's row for a
  request holds its tokens from the second on, so position p's token is the request's token p + 1 and the
  last known token's row predicts the first draft. Known positions take the target's features; the drafts'
  positions take the head's own hidden state of the position before (the tree-free chain: one draft per
  request per decode round, all requests batched).
- What stays valid. Head K/V of a position is valid only when computed from the target's feature, so the
  drafts' positions are never kept: the next fill catches up from the first position past the last call's
  known tokens, with the features the target computed since (those positions it accepted).

A position whose feature the target never computed (a prefix-cache hit, or one consumed before an eviction of
the head's cache) takes zeros: worse drafts, never a different output (verification decides what is kept).

Bounded features: a finished request's are dropped (forget()); a request that decodes without drafts (not
speculating that step) keeps only its newest max_chunk_tokens rows (one catch-up round's worth: what a resumed
catch-up reads just before its drafts); and after every observe() the rows kept over all requests are at most
max_feature_rows (by default the positions the head's KV cache holds: no fill's catch-ups read more), taken
first from requests not speculating, then from ones still in their prompt, then from speculating ones, least
recently observed first, each losing its oldest positions first (a later catch-up takes zeros there).
"""

from __future__ import annotations

from enum import IntEnum

import torch

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kvpilot.model.draft_proposer import DraftModelProposer, _DraftState
from kvpilot.model.models.eagle import EagleHead
from kvpilot.model.runner import ModelRunner


class _Use(IntEnum):
    """What a request did at its last observed step; the bound on features drops rows of the lowest first."""

    idle = 0  # decoded without drafts
    prompt = 1  # a prompt chunk
    drafting = 2  # verified drafts


class EagleProposer(DraftModelProposer):
    """Greedy drafts from an EAGLE head (the module docstring); `runner` runs the head (an EagleHead);
    max_feature_rows: the most target feature rows kept over all requests (None: the head cache's positions)."""

    def __init__(self, runner: ModelRunner, max_chunk_tokens: int, max_feature_rows: int | None = None) -> None:
        super().__init__(runner, max_chunk_tokens)
        assert isinstance(runner.model, EagleHead)
        self.head: EagleHead = runner.model
        self.max_feature_rows = runner.num_blocks * runner.block_size if max_feature_rows is None else max_feature_rows
        if self.max_feature_rows < 1:
            raise ValueError(f"max_feature_rows must be >= 1, got {self.max_feature_rows}")
        # per request, least recently observed first: segments (first position, [n, feature]) of the target's
        # features not yet consumed, in increasing positions
        self._features: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._use: dict[str, _Use] = {}  # per request with features: what it did at its last observed step
        self._fed: dict[str, torch.Tensor] = {}  # per request: the head's last hidden state [1, H] of this fill

    @property
    def num_featured_requests(self) -> int:
        return len(self._features)

    @property
    def num_feature_rows(self) -> int:
        """The target feature rows kept over all requests (at most max_feature_rows after each observe())."""
        return sum(_num_rows(segments) for segments in self._features.values())

    # ---- the target's side ------------------------------------------------------------------------------

    def observe(self, chunks: list[ScheduledChunk], draft_token_ids: dict[str, list[int]], hidden: torch.Tensor,
                aux_hidden: torch.Tensor | None) -> None:
        """A target step's features: `hidden` its last hidden states [T, H] (normed), `aux_hidden` its aux layers'
        inputs [T, 3H] (EAGLE-3), rows in chunk order (a chunk verifying k drafts: 1 + k rows)."""
        states = aux_hidden if self.head.kind == "eagle3" else hidden
        if states is None:
            raise RuntimeError("an EAGLE-3 head needs the target's aux hidden states (aux_hidden_layers unset)")
        offset = 0
        for chunk in chunks:
            drafts = draft_token_ids.get(chunk.request_id)
            num_rows = len(drafts) + 1 if drafts else chunk.num_tokens
            rid = chunk.request_id
            self._drop_from(rid, chunk.start_position)
            segments = self._features.pop(rid, [])  # re-inserted: now the most recently observed
            segments.append((chunk.start_position, states[offset:offset + num_rows].clone()))
            self._features[rid] = segments
            use = _Use.drafting if drafts else _Use.idle if chunk.is_decode else _Use.prompt
            self._use[rid] = use
            if use == _Use.idle:
                self._keep_newest(rid, self.max_chunk_tokens)
            offset += num_rows
        self._bound()

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._features.pop(request_id, None)
        self._use.pop(request_id, None)
        self._fed.pop(request_id, None)

    # ---- the proposer's hooks ---------------------------------------------------------------------------

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        if request.num_tokens < 2:  # no feature yet: the first head position reads the target's at position 0
            return []
        return super().propose(request, max_drafts)

    def _known(self, request: Request) -> list[int]:
        return request.all_token_ids[1:]

    def _remember(self, request: Request, state: _DraftState, drafts: list[int]) -> None:
        known = request.num_tokens - 1
        state.num_known, state.fed_draft_ids = known, []  # the drafts' K/V came from the head's own states
        self._drop_below(request.request_id, known - 1)  # the next catch-up starts at known - 1 at the earliest
        self._fed.pop(request.request_id, None)

    @torch.inference_mode()
    def _run(self, output: SchedulerOutput, num_known: dict[str, int]) -> dict[str, int]:
        head = self.head
        parts = []
        for chunk in output.chunks:
            rid = chunk.request_id
            if chunk.start_position < num_known[rid]:  # catch-up: the target's features
                parts.append(head.combine(self._features_at(rid, chunk.start_position, chunk.num_tokens)))
            else:  # a draft's position: the head's own state at the position before
                parts.append(self._fed[rid])
        head.input_hidden = torch.cat(parts)
        try:
            sampled = self.runner.execute_model(output).result().token_ids
            last, end = head.last_hidden, 0
            assert last is not None
            for chunk in output.chunks:
                end += chunk.num_tokens
                self._fed[chunk.request_id] = last[end - 1:end]
        finally:
            head.input_hidden = head.last_hidden = None
        return sampled

    # ---- the feature store ------------------------------------------------------------------------------

    def _features_at(self, request_id: str, start: int, num: int) -> torch.Tensor:
        """The target's features at positions start .. start + num - 1 ([num, feature]; zeros where missing)."""
        segments = self._features.get(request_id, [])
        if len(segments) == 1 and segments[0][0] == start and segments[0][1].shape[0] == num:
            return segments[0][1]
        width = self.head.fc.in_features if self.head.kind == "eagle3" else self.head.config.hidden_size
        out = torch.zeros(num, width, dtype=self.runner.loaded.dtype, device=self.runner.device)
        for first, tensor in segments:
            lo, hi = max(first, start), min(first + tensor.shape[0], start + num)
            if lo < hi:
                out[lo - start:hi - start] = tensor[lo - first:hi - first]
        return out

    def _drop_from(self, request_id: str, position: int) -> None:
        segments = self._features.get(request_id)
        if not segments:
            return
        kept = [(first, tensor[:position - first]) for first, tensor in segments if first < position]
        self._features[request_id] = kept

    def _drop_below(self, request_id: str, position: int) -> None:
        segments = self._features.get(request_id)
        if not segments:
            return
        kept = [(max(first, position), tensor[max(position - first, 0):]) for first, tensor in segments
                if first + tensor.shape[0] > position]
        self._features[request_id] = kept

    def _keep_newest(self, request_id: str, num_rows: int) -> None:
        """Drops a request's oldest feature rows until at most num_rows are left."""
        segments = self._features[request_id]
        excess = _num_rows(segments) - num_rows
        while excess > 0 and segments:
            first, tensor = segments[0]
            if tensor.shape[0] <= excess:
                segments.pop(0)
                excess -= tensor.shape[0]
            else:
                segments[0] = (first + excess, tensor[excess:])
                excess = 0

    def _bound(self) -> None:
        """Drops rows until at most max_feature_rows are kept (the order of the module docstring)."""
        excess = self.num_feature_rows - self.max_feature_rows
        if excess <= 0:
            return
        for rid in sorted(self._features, key=lambda r: self._use[r]):  # stable: least recently observed first
            held = _num_rows(self._features[rid])
            self._keep_newest(rid, max(held - excess, 0))
            excess -= held - _num_rows(self._features[rid])
            if excess <= 0:
                return


def _num_rows(segments: list[tuple[int, torch.Tensor]]) -> int:
    return sum(int(tensor.shape[0]) for _, tensor in segments)
