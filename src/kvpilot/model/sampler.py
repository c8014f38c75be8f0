"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

One pass over the whole [N, vocab] logits for every filter; only the random draw of a seeded request uses
its own generator (so its output does not depend on what else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvpilot.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors. Invariant: all tensors have N rows, on the logits' device."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    top_k: torch.Tensor  # [N] long, vocab size when off
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    all_greedy: bool
    generators: list[torch.Generator | None]

    @staticmethod
    def build(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        def col(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return SamplingBatch(
            temperature=col([p.temperature for p in params], torch.float32),
            top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.long),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            all_greedy=all(p.is_greedy for p in params),
            generators=list(generators))


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks tokens outside top-k / top-p / min-p with -inf (rows sorted once for all three)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    remove = ranks >= batch.top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    remove |= (cumulative - probs) > batch.top_p[:, None]  # keep the smallest prefix reaching top_p
    remove |= probs < (batch.min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(shape: torch.Size, generators: list[torch.Generator | None],
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


@dataclass(frozen=True)
class SampleResult:
    """One row's sampled token; with logprobs requested, its log-probability and the top-N alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]) -> list[SampleResult]:
    """Log-softmax of the (processed) logits: the sampled token's logprob and the top-N per row."""
    wanted = [n for n in num_top if n is not None]
    if not wanted:
        return [SampleResult(int(t)) for t in token_ids.tolist()]
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(max(max(wanted), 1), dim=-1)
    results = []
    for row, (token, n) in enumerate(zip(token_ids.tolist(), num_top)):
        if n is None:
            results.append(SampleResult(token))
            continue
        top = list(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist()))
        results.append(SampleResult(token, chosen[row], top))
    return results


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [N] for float32 logits [N, vocab]. Greedy rows take the argmax (ties: lowest id)."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    probs = _filter(logits / temperature[:, None], batch).softmax(dim=-1)
    # Gumbel-max via exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly.
    sampled = (probs / _exponential_noise(probs.shape, batch.generators, logits.device)).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy_ids)
