"""Pure-Python stand-ins used by the engine unit tests: a manual clock, a paged fake model, a driver loop.

The fake model is not a mock of the engine: it exercises the scheduler's contract the way the real runner
does. It writes every computed token into a slot map through the chunk's block table, then "samples" the
next token as a function of the whole context read back through the block table. A wrong block id, a
premature prefix-cache hit or a stale block table changes the context and hence the generated tokens,
which the tests compare against the same function run on each prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.engine.block_pool import BlockPool, HashFn, chained_block_hash
from kvpilot.engine.config import CacheConfig, SchedulerConfig
from kvpilot.engine.request import Request
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import RequestUpdate, SchedulerOutput
from kvpilot.sampling_params import SamplingParams

VOCAB_OFFSET = 100
VOCAB_SIZE = 64


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> None:
        self.now += seconds


def next_token(context: list[int]) -> int:
    """Deterministic 'model': depends on every token and its position (hash of ints is process-stable)."""
    return VOCAB_OFFSET + hash(tuple(context)) % VOCAB_SIZE


def generate_alone(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fake model produces for one prompt run by itself (ignore_eos, max_tokens tokens)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakePagedModel:
    """Writes chunks into a slot map (slot -> (position, token)) and samples from what it reads back."""

    def __init__(self, block_size: int, pool: BlockPool | None = None) -> None:
        self.block_size = block_size
        self.pool = pool
        self.slots: dict[int, tuple[int, int]] = {}
        self.num_steps = 0

    def _slot(self, block_ids: list[int], position: int) -> int:
        if position // self.block_size >= len(block_ids):
            raise AssertionError(f"position {position} is beyond the block table {block_ids}")
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, output: SchedulerOutput) -> dict[str, int]:
        self.num_steps += 1
        for chunk in output.chunks:
            for i, token in enumerate(chunk.token_ids):
                position = chunk.start_position + i
                block_id = chunk.block_ids[position // self.block_size]
                if self.pool is not None and self.pool.blocks[block_id].block_hash is not None:
                    raise AssertionError(f"{chunk.request_id} writes into cached (immutable) block {block_id}")
                self.slots[self._slot(chunk.block_ids, position)] = (position, token)
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            if chunk.needs_sample:
                end = chunk.start_position + len(chunk.token_ids)
                context = [self._read(chunk.block_ids, p) for p in range(end)]
                sampled[chunk.request_id] = next_token(context)
        return sampled

    def _read(self, block_ids: list[int], position: int) -> int:
        stored_position, token = self.slots[self._slot(block_ids, position)]
        if stored_position != position:
            raise AssertionError(f"slot for position {position} holds position {stored_position}")
        return token


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 10,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    eos_token_id: int | None = None,
    clock: Callable[[], float] | None = None,
    hash_fn: HashFn = chained_block_hash,
) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching)
    sched = SchedulerConfig(
        max_model_len=max_model_len or block_size * num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(sched, cache, eos_token_id, clock or ManualClock(), hash_fn=hash_fn)


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    params.setdefault("ignore_eos", True)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(request_id, prompt, sampling, arrival_time=arrival_time, priority=priority)


def step(scheduler: Scheduler, model: FakePagedModel) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One engine iteration: schedule, run the fake model (1 s on a ManualClock), update, check invariants."""
    output = scheduler.schedule()
    sampled = model.run(output)
    if isinstance(scheduler.clock, ManualClock):
        scheduler.clock.advance(1.0)
    updates = scheduler.update_from_output(output, sampled)
    scheduler.check_integrity()
    return output, updates


def run_to_completion(
    scheduler: Scheduler, model: FakePagedModel, max_steps: int = 2000
) -> list[SchedulerOutput]:
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        if len(outputs) >= max_steps:
            raise AssertionError(f"no completion after {max_steps} steps: the scheduler is stuck")
        outputs.append(step(scheduler, model)[0])
    return outputs
