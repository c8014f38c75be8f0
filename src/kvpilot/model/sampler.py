"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

One pass over the whole [N, vocab] logits for every filter; only the random draw of a seeded request uses
its own generator (so its output does not depend on what else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvpilot.engine.scheduler_output import SampledToken
from kvpilot.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors. Invariant: all tensors have N rows, on the logits' device;
    generators maps a row to its request's seeded generator (rows without a seed draw from the global one)."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    top_k: torch.Tensor  # [N] long, vocab size when off
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    all_greedy: bool
    generators: dict[int, torch.Generator]

    @staticmethod
    def build(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        return SamplingBatch.from_columns(
            np.array([0.0 if p.is_greedy else p.temperature for p in params], dtype=np.float32),
            np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float32), np.array([p.min_p for p in params], dtype=np.float32),
            {i: g for i, g in enumerate(generators) if g is not None}, vocab_size, device)

    @staticmethod
    def from_columns(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                     generators: dict[int, torch.Generator], vocab_size: int,
                     device: torch.device) -> "SamplingBatch":
        """From host columns (top_k 0 = off); all_greedy is decided on the host, with no device sync."""
        all_greedy = not bool((temperature > 0).any())
        if all_greedy:  # the filters are never read: skip four host-to-device copies
            empty = torch.empty(0, device=device)
            return SamplingBatch(empty, empty, empty, empty, True, generators)

        def col(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device)

        return SamplingBatch(temperature=col(temperature), top_k=col(np.where(top_k > 0, top_k, vocab_size)),
                             top_p=col(top_p), min_p=col(min_p), all_greedy=False, generators=generators)


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


def _exponential_noise(shape: torch.Size, generators: dict[int, torch.Generator],
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return noise


@dataclass(frozen=True)
class Logprobs:
    """Device tensors of one step's log-probabilities, for the rows that asked: chosen [N] (the sampled token's),
    top_values / top_ids [N, max_top]. Converted to host values only when the step's result is read."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int) -> Logprobs:
    """Log-softmax of the (processed) logits: the sampled token's logprob and the top max_top per row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    top_values, top_ids = logprobs.topk(max(max_top, 1), dim=-1)
    return Logprobs(chosen, top_values, top_ids)


def sampled_tokens(token_ids: list[int], num_top: Sequence[int], logprobs: Logprobs | None) -> list[SampledToken]:
    """Host-side results; num_top[i] < 0 means row i asked for no logprobs."""
    if logprobs is None:
        return [SampledToken(t) for t in token_ids]
    chosen, values, ids = logprobs.chosen.tolist(), logprobs.top_values.tolist(), logprobs.top_ids.tolist()
    return [SampledToken(t) if n < 0 else SampledToken(t, chosen[i], list(zip(ids[i][:n], values[i][:n])))
            for i, (t, n) in enumerate(zip(token_ids, num_top))]


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
