"""logit_bias: per-request additive biases on chosen token logits (OpenAI semantics: the value is added to
the token's logit before sampling, so -100 bans it and +100 all but forces it). Rows without a bias cost one
integer test per step; a step with biased rows costs one index_put over their entries."""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.sampling_params import SamplingParams


class LogitBiasState:
    """Invariant: biases[r] is (token ids, values) for a held row r whose request has a non-empty
    logit_bias (ids in the vocabulary: SamplingParams.check_vocab ran at admission), else None."""

    def __init__(self, max_rows: int) -> None:
        self.biases: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_rows
        self.num_active = 0

    def add(self, row: int, params: SamplingParams) -> None:
        self.remove(row)
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
            values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
            self.biases[row] = (ids, values)
            self.num_active += 1

    def remove(self, row: int) -> None:
        if self.biases[row] is not None:
            self.biases[row] = None
            self.num_active -= 1

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """logits [N, vocab] of persistent `rows` -> biased logits (a copy when any row has a bias)."""
        if not self.num_active:
            return logits
        row_index, ids, values = [], [], []
        for i, row in enumerate(rows.tolist()):
            bias = self.biases[row]
            if bias is not None:
                row_index.append(np.full(len(bias[0]), i, dtype=np.int64))
                ids.append(bias[0])
                values.append(bias[1])
        if not row_index:
            return logits
        device = logits.device
        logits = logits.clone()
        logits.index_put_((torch.from_numpy(np.concatenate(row_index)).to(device),
                           torch.from_numpy(np.concatenate(ids)).to(device)),
                          torch.from_numpy(np.concatenate(values)).to(device, logits.dtype), accumulate=True)
        return logits
