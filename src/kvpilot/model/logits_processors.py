"""Logits adjustments applied before sampling, kept incrementally on the device: repetition / presence /
frequency penalties and min_tokens (stop tokens masked until enough tokens were generated). Rows with
default settings are untouched and cost nothing.

Conventions follow vLLM: repetition_penalty applies to prompt and output tokens (divide positive logits,
multiply negative ones); presence and frequency penalties to output tokens only (OpenAI's definition).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvpilot.model.device_staging import PackedArrays
from kvpilot.sampling_params import SamplingParams


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class PenaltyState:
    """Per-row token statistics for rows whose request uses a penalty: which tokens its prompt holds and how
    often each was generated, as [max_rows, vocab] device tensors allocated on first use and updated by one
    scatter per step (no history is re-read). Invariant: active[r] iff row r's request uses a penalty."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.active = np.zeros(max_rows, dtype=bool)
        self.num_active = 0  # rows with active set: none (the usual case) skips every per-step gather
        self.repetition = np.ones(max_rows, dtype=np.float32)
        self.frequency = np.zeros(max_rows, dtype=np.float32)
        self.presence = np.zeros(max_rows, dtype=np.float32)
        self._prompt_seen: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None
        # CUDA: per-step row indices and columns go in one asynchronous copy each (no wait for queued kernels)
        cuda = device.type == "cuda"
        self._index_staging = PackedArrays(device) if cuda else None
        self._column_staging = PackedArrays(device, dtype=torch.float32) if cuda else None

    def _indices(self, mask: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the step of the penalized rows, their persistent rows) on the device."""
        which, penalized = np.flatnonzero(mask), rows[mask]
        if self._index_staging is None:
            return torch.from_numpy(which).to(self.device), torch.from_numpy(penalized).to(self.device)
        which_t, penalized_t = self._index_staging.pack([which, penalized])
        return which_t.long(), penalized_t.long()

    def _columns(self, penalized: np.ndarray) -> list[torch.Tensor]:
        """repetition, frequency, presence of the penalized rows, [n, 1] each, on the device."""
        columns = [self.repetition[penalized], self.frequency[penalized], self.presence[penalized]]
        if self._column_staging is None:
            return [torch.from_numpy(c).to(self.device)[:, None] for c in columns]
        return [c[:, None] for c in self._column_staging.pack(columns)]

    def add(self, row: int, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.num_active += uses_penalties(params) - bool(self.active[row])
        self.active[row] = uses_penalties(params)
        if not self.active[row]:
            return
        if self._prompt_seen is None:
            self._prompt_seen = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self._output_counts = torch.zeros(self.max_rows, self.vocab_size, device=self.device)
        assert self._output_counts is not None
        self.repetition[row], self.frequency[row] = params.repetition_penalty, params.frequency_penalty
        self.presence[row] = params.presence_penalty
        self._prompt_seen[row] = False
        self._prompt_seen[row, torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)] = True
        self._output_counts[row] = 0
        if output_ids:
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=self.device)
            self._output_counts[row].index_add_(0, ids, torch.ones(len(ids), device=self.device))

    def remove(self, row: int) -> None:
        self.num_active -= bool(self.active[row])
        self.active[row] = False

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """logits [N, vocab] of the requests in `rows` (persistent rows) -> penalized logits."""
        if not self.num_active:
            return logits
        mask = self.active[rows]
        if not mask.any():
            return logits
        assert self._prompt_seen is not None and self._output_counts is not None
        which, penalized_rows = self._indices(mask, rows)
        counts = self._output_counts[penalized_rows]
        seen = self._prompt_seen[penalized_rows] | (counts > 0)
        sub = logits[which]
        repetition, frequency, presence = self._columns(rows[mask])
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - frequency * counts - presence * (counts > 0)
        logits = logits.clone()
        logits[which] = sub
        return logits

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Counts each row's just-sampled token (on the device: no host sync)."""
        if not self.num_active:
            return
        mask = self.active[rows]
        if not mask.any():
            return
        assert self._output_counts is not None
        which, penalized_rows = self._indices(mask, rows)
        self._output_counts.index_put_((penalized_rows, token_ids[which]),
                                       torch.ones(len(which), device=token_ids.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Masks banned[i] (EOS and stop tokens of a row short of min_tokens; usually empty) in row i."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if not rows:
        return logits
    cols = [t for ids in banned for t in ids]
    logits = logits.clone()
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits
