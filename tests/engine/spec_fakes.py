"""Speculative decoding over the pure-Python fakes: a paged fake model that verifies drafts the way the runner
does, an oracle proposer with a chosen accuracy, and a driver that checks the scheduler after every step."""

from __future__ import annotations

import dataclasses
import random

from kvpilot.engine.request import Request
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.engine.speculator import DraftProposer, Speculator
from tests.engine.engine_fakes import VOCAB_OFFSET, VOCAB_SIZE, FakePagedModel, next_token, window_context


class FakeVerifyingModel(FakePagedModel):
    """FakePagedModel plus drafts: a chunk with drafts writes its last known token and the drafts, computes
    the target's token after each position from what it reads back through its block table, emits them up
    to the first that differs from its draft, and rolls its own computed count back. trimmed_tables cut its
    tables before new blocks are appended, as the runner's."""

    def _apply_diff(self, output: SchedulerOutput) -> None:
        for request_id, num_blocks in output.trimmed_tables.items():
            if request_id in self.rows:
                del self.rows[request_id].block_ids[num_blocks:]
        super()._apply_diff(output)

    def run_verifying(self, output: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        drafts = output.draft_token_ids
        sampled = self.run(dataclasses.replace(output, chunks=[c for c in output.chunks if c.request_id not in drafts]))
        verified = {c.request_id: self._verify(c, drafts[c.request_id]) for c in output.chunks
                    if c.request_id in drafts}
        sampled.update({rid: tokens[0] for rid, tokens in verified.items()})
        return sampled, verified

    def _verify(self, chunk: ScheduledChunk, drafts: list[int]) -> list[int]:
        row = self.rows[chunk.request_id]
        start = chunk.start_position
        assert start == row.num_computed == len(row.token_ids) - 1, (chunk, row.num_computed, len(row.token_ids))
        assert chunk.num_tokens == 1 + len(drafts) and chunk.needs_sample
        tokens = row.token_ids + drafts
        for position in range(start, start + chunk.num_tokens):
            block_id = row.block_ids[position // self.block_size]
            if self.pool is not None and self.pool.blocks[block_id].block_hash is not None:
                raise AssertionError(f"{chunk.request_id} writes a draft into cached block {block_id}")
            self.slots[self._slot(row.block_ids, position)] = (position, tokens[position])
        emitted: list[int] = []
        for j in range(len(drafts) + 1):
            num = start + j + 1  # tokens the query at position start + j attends over
            first = 0 if self.window is None else max(0, num - self.window)
            context = [self._read(row.block_ids, p) for p in range(first, num)]
            emitted.append(next_token(context if self.window is None else [num, *context]))
            if j == len(drafts) or emitted[-1] != drafts[j]:
                break
        row.token_ids += emitted
        row.num_computed = start + len(emitted)
        return emitted


class OracleProposer:
    """Drafts the fake model's true continuation, each token right with probability `accuracy` (else a wrong
    one), so verifications accept some drafts and reject others."""

    def __init__(self, accuracy: float, seed: int = 0, window: int | None = None) -> None:
        self.accuracy, self.rng, self.window = accuracy, random.Random(seed), window
        self.forgotten: set[str] = set()

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        tokens = list(request.all_token_ids)
        drafts: list[int] = []
        for _ in range(max_drafts):
            true = next_token(window_context(tokens, self.window))
            guess = true if self.rng.random() < self.accuracy else VOCAB_OFFSET + (true - VOCAB_OFFSET + 1) % VOCAB_SIZE
            drafts.append(guess)
            tokens.append(guess)
        return drafts

    def forget(self, request_id: str) -> None:
        self.forgotten.add(request_id)


def always_speculate(scheduler: Scheduler, proposer: DraftProposer, num_drafts: int = 4) -> Speculator:
    """Gives the scheduler a speculator whose draft rows cost nothing: every eligible decode gets drafts."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=num_drafts, prompt_lookup_min=1,
                                              prompt_lookup_max=3), proposer)
    speculator.step_price = lambda num_running: 0.0  # type: ignore[method-assign]
    scheduler.speculator = speculator
    return speculator


@dataclasses.dataclass
class SpecRun:
    """What a run produced: every request's tokens and finish reason, and every step's diff."""

    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str]
    outputs: list[SchedulerOutput]


def run_verifying(scheduler: Scheduler, model: FakeVerifyingModel, max_steps: int = 3000,
                  draft_seconds: float = 0.0) -> SpecRun:
    """Synchronous engine loop over the fake; after each step: integrity, and each running request's runner
    table equals the KV manager's (a stale trimmed table would write through freed blocks). `draft_seconds`:
    what each step's drafting took in the runner, as a draft model's RunnerOutput reports it."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "no completion: the scheduler is stuck"
        output = scheduler.schedule()
        sampled, verified = model.run_verifying(output)
        for update in scheduler.update_from_output(output, sampled, verified, draft_seconds):
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                reasons[update.request_id] = update.finish_reason.value
        scheduler.check_integrity()
        for request in scheduler._running:  # (the runner keeps old ids where a window released blocks)
            if request.request_id in model.rows and request.request_id not in scheduler._trimmed:
                runner_table = model.rows[request.request_id].block_ids
                num_null = scheduler.kv._tables[request.request_id].num_null_blocks
                assert len(runner_table) == len(request.block_ids), request
                assert runner_table[num_null:] == request.block_ids[num_null:], request
        outputs.append(output)
    return SpecRun(tokens, reasons, outputs)
