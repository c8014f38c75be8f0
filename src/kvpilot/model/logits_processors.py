"""Batched logits adjustments applied before sampling: repetition / presence / frequency penalties and
min_tokens (stop tokens masked until enough tokens were generated). Rows with default settings are untouched.

Conventions follow vLLM: repetition_penalty applies to prompt and output tokens (divide positive logits,
multiply negative ones); presence and frequency penalties to output tokens only (OpenAI's definition).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kvpilot.sampling_params import SamplingParams


class TokenHistory(Protocol):
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _counts(rows: Sequence[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, vocab] occurrence counts of each row's token ids (one scatter_add for the whole batch)."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    if width == 0:
        return counts[:, :vocab_size]
    ids = torch.full((len(rows), width), vocab_size, dtype=torch.long)  # padding lands in the extra column
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, histories: Sequence[TokenHistory]) -> torch.Tensor:
    params = [h.sampling_params for h in histories]
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
           for p in params):
        return logits
    vocab, device = logits.shape[-1], logits.device
    output_counts = _counts([h.output_token_ids for h in histories], vocab, device)
    seen = (_counts([h.prompt_token_ids for h in histories], vocab, device) + output_counts) > 0
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * output_counts - presence * (output_counts > 0)


def apply_min_tokens(logits: torch.Tensor, histories: Sequence[TokenHistory], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Masks EOS and stop_token_ids for rows that have not yet generated min_tokens tokens."""
    rows, cols = [], []
    for i, history in enumerate(histories):
        params = history.sampling_params
        if len(history.output_token_ids) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits
