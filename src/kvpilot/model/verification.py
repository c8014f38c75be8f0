"""Which drafts the target accepts, decided on the host when a verifying step's sampled ids arrive.

At each verified position j the runner samples the target's token x_j exactly as plain decoding would (the
same processed logits, the same sampler, for a seeded request the same uniform: the one its stream gives
that output position). The draft d_j is accepted iff x_j == d_j, and the step emits x_0 .. x_a, a being the
first rejected position (or k when all k drafts are accepted: x_k is the target's own next token).

That is the standard rejection rule for a deterministic proposer, whose draft distribution q is a point mass
at d: accept with probability min(1, p(d) / q(d)) = p(d), and on rejection sample from (p - q)+ renormalised,
i.e. p with d removed. Here P(x_j == d_j) = p_j(d_j), and given x_j != d_j, x_j is distributed as p_j
without d_j: the same law. Greedy rows (p a point mass at the argmax) accept while the argmax equals the
draft. Because x_j is plain decoding's own draw, a seeded request's tokens are the ones it gets without
speculation; its stream is rewound to the positions the step kept (the rejected positions' uniforms are
drawn again next step), so what follows does not depend on how many drafts were tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvpilot.model.input_batch import InputBatch
from kvpilot.model.sampler import advance_generator


@dataclass
class Verification:
    """A launched verifying step's bookkeeping. offsets[i] / counts[i]: sampled chunk i's rows in the step's
    sampled ids; drafts[i]: its drafts (None when it had none); rewinds: (i, its seeded generator, the
    generator's state before the step)."""

    offsets: list[int]
    counts: list[int]
    drafts: list[list[int] | None]
    rewinds: list[tuple[int, torch.Generator, torch.Tensor]] = field(default_factory=list)


def accepted_tokens(ids: Sequence[int], offset: int, drafts: Sequence[int]) -> list[int]:
    """The tokens a verification emits: the target's ids at ids[offset:] up to and including the first that
    differs from its draft, or all k + 1 when every draft matches."""
    num_accepted = 0
    while num_accepted < len(drafts) and ids[offset + num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return list(ids[offset:offset + num_accepted + 1])


def finish_verification(batch: InputBatch, verification: Verification, request_ids: Sequence[str],
                        rows: np.ndarray, positions: np.ndarray, ids: Sequence[int],
                        device: torch.device) -> dict[str, list[int]]:
    """After commit() wrote each chunk's first token: appends the verified chunks' further tokens to their
    rows, rewinds seeded streams to the tokens kept, and returns {request id: emitted tokens} for the
    chunks that had drafts."""
    verified: dict[str, list[int]] = {}
    for i, drafts in enumerate(verification.drafts):
        if not drafts:
            continue
        tokens = accepted_tokens(ids, verification.offsets[i], drafts)
        request_id, row = request_ids[i], int(rows[i])
        verified[request_id] = tokens
        if batch.rows.get(request_id) == row:
            batch.append_verified(row, int(positions[i]), tokens[1:])
    for i, generator, state in verification.rewinds:
        generator.set_state(state)
        advance_generator(generator, len(verified[request_ids[i]]), device)
    return verified


def plan_verification(counts: np.ndarray, request_ids: Sequence[str], drafts: dict[str, list[int]],
                      generators: dict[str, torch.Generator]) -> Verification:
    """The bookkeeping of a verifying step's sampled chunks (counts: StepInputs.sample_counts); saves the
    state of each seeded stream about to draw for several positions."""
    count_list = counts.tolist()
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist() if len(counts) else []
    chunk_drafts = [drafts.get(rid) for rid in request_ids]
    rewinds = [(i, generators[rid], generators[rid].get_state()) for i, rid in enumerate(request_ids)
               if chunk_drafts[i] and rid in generators]
    return Verification(offsets, count_list, chunk_drafts, rewinds)


def expanded_generators(verification: Verification, request_ids: Sequence[str],
                        generators: dict[str, torch.Generator]) -> dict[int, torch.Generator]:
    """Sampled row -> seeded generator for a verifying step, rows in order (a request's positions draw from
    its stream one after another, as its successive plain decoding steps would)."""
    rows: dict[int, torch.Generator] = {}
    for i, rid in enumerate(request_ids):
        generator = generators.get(rid)
        if generator is not None:
            for j in range(verification.counts[i]):
                rows[verification.offsets[i] + j] = generator
    return rows
