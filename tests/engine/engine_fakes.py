"""Pure-Python stand-ins used by the engine unit tests: a manual clock, a paged fake model, a driver loop.

The fake model is not a mock of the engine: it consumes the scheduler's step diffs the way the real runner
does, keeping its own per-request tokens and block tables (new requests arrive whole, running ones send
only new block ids), and appending the tokens it samples itself (so a step may be scheduled before the
previous one's tokens reach the scheduler). It writes every computed token into a slot map through its
block table, then "samples" the next token as a function of the whole context read back through the block
table. A wrong block id, a premature prefix-cache hit, a stale or lost diff changes the context and hence
the generated tokens, which the tests compare against the same function run on each prompt alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

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


def window_context(tokens: list[int], window: int | None) -> list[int]:
    """What the fake model samples from: the whole context, or with a sliding window W the number of tokens
    so far and the last W of them (the keys the last token's query reads, itself included)."""
    return tokens if window is None else [len(tokens), *tokens[-window:]]


def generate_alone(prompt: list[int], max_tokens: int, window: int | None = None,
                   extra_windows: tuple[int | None, ...] = ()) -> list[int]:
    """What the fake model produces for one prompt run by itself (ignore_eos, max_tokens tokens); with KV
    groups 1.. of `extra_windows`, from what each group's layers read, one after the other."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        context = window_context(tokens, window)
        for extra in extra_windows:
            context = [*context, *window_context(tokens, extra)]
        tokens.append(next_token(context))
    return tokens[len(prompt):]


@dataclass
class _FakeRow:
    """The fake runner's state of one request, built from the diffs only."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    sampled: list[int] = field(default_factory=list)
    extra_block_ids: list[list[int]] = field(default_factory=list)  # KV groups 1..


class FakePagedModel:
    """Writes chunks into a slot map (slot -> (position, token)) and samples from what it reads back: the whole
    context, or with `window` only the last `window` positions (as sliding-window attention reads them). With
    KV groups (`extra_windows`: groups 1..'s windows) it writes every token through each group's table too,
    remembers which group wrote each slot, and samples from what every group reads (generate_alone's order)."""

    def __init__(self, block_size: int, pool: BlockPool | None = None, window: int | None = None,
                 extra_windows: tuple[int | None, ...] = ()) -> None:
        self.block_size = block_size
        self.pool = pool
        self.window = window
        self.windows = (window, *extra_windows)
        self.slot_groups: dict[int, int] = {}
        self.slots: dict[int, tuple[int, int]] = {}
        self.rows: dict[str, _FakeRow] = {}
        self.num_steps = 0
        # KV offload tiers, as the runner keeps them: slot -> the block's slots' contents (None: never written)
        self.host: dict[int, list[tuple[int, int] | None]] = {}
        self.disk: dict[int, list[tuple[int, int] | None]] = {}

    def _slot(self, block_ids: list[int], position: int) -> int:
        if position // self.block_size >= len(block_ids):
            raise AssertionError(f"position {position} is beyond the block table {block_ids}")
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _apply_diff(self, output: SchedulerOutput) -> None:
        for request_id in [*output.finished_request_ids, *output.preempted_request_ids]:
            self.rows.pop(request_id, None)
        for new in output.new_requests:
            if new.request_id in self.rows:
                raise AssertionError(f"{new.request_id} sent as new while the runner holds it")
            self.rows[new.request_id] = _FakeRow([*new.prompt_token_ids, *new.output_token_ids],
                                                 list(new.block_ids), new.num_computed_tokens,
                                                 extra_block_ids=[list(ids) for ids in new.extra_block_ids])
        for running in output.running_requests:
            row = self.rows[running.request_id]
            if row.num_computed != running.num_computed_tokens:
                raise AssertionError(f"{running.request_id}: runner computed {row.num_computed}, diff says "
                                     f"{running.num_computed_tokens}")
            row.block_ids.extend(running.new_block_ids)
            for ids, new_ids in zip(row.extra_block_ids, running.new_extra_block_ids, strict=False):
                ids.extend(new_ids)

    def _block(self, block_id: int) -> list[tuple[int, int] | None]:
        return [self.slots.get(block_id * self.block_size + i) for i in range(self.block_size)]

    def _write_block(self, block_id: int, contents: list[tuple[int, int] | None]) -> None:
        for i, content in enumerate(contents):
            slot = block_id * self.block_size + i
            if content is None:
                self.slots.pop(slot, None)
            else:
                self.slots[slot] = content

    def _copy(self, output: SchedulerOutput) -> None:
        """The step's offload copy orders, in the runner's order, each list read before it is written (as a
        batched copy does: engine/kv_offload.py says why no list reads what it writes)."""
        orders = output.offload
        if orders is None:
            return
        self.disk.update({d: list(self.host[h]) for h, d in orders.demotes})
        self.host.update({slot: self._block(block) for block, slot in orders.saves})
        self.disk.update({slot: self._block(block) for block, slot in orders.disk_saves})
        loads = [(block, self.host[slot]) for slot, block in orders.loads] + \
            [(block, self.disk[slot]) for slot, block in orders.disk_loads]
        for block, contents in loads:
            self._write_block(block, list(contents))

    def _copy_beside(self, output: SchedulerOutput) -> None:
        """The prefetch loads that run beside the step's forward: applied after it, so a chunk of the step
        that read a prefetched block would have found it empty."""
        orders = output.offload
        if orders is None:
            return
        loads = [(block, self.host[slot]) for slot, block in orders.beside_loads] + \
            [(block, self.disk[slot]) for slot, block in orders.beside_disk_loads]
        for block, contents in loads:
            self._write_block(block, list(contents))

    def run(self, output: SchedulerOutput) -> dict[str, int]:
        self.num_steps += 1
        self._copy(output)
        self._apply_diff(output)
        for chunk in output.chunks:
            row = self.rows[chunk.request_id]
            if chunk.start_position != row.num_computed:
                raise AssertionError(f"{chunk.request_id}: chunk starts at {chunk.start_position}, runner "
                                     f"computed {row.num_computed}")
            for group, (window, block_ids) in enumerate(zip(self.windows, self._tables(row))):
                if window is not None:  # the chunk's first query reads these earlier keys: still there?
                    for position in range(max(0, chunk.start_position - window + 1), chunk.start_position):
                        self._read(block_ids, position, group)
                for position in range(chunk.start_position, chunk.start_position + chunk.num_tokens):
                    block_id = block_ids[position // self.block_size]
                    if self.pool is not None and self.pool.blocks[block_id].block_hash is not None:
                        raise AssertionError(f"{chunk.request_id} writes into cached (immutable) block {block_id}")
                    slot = self._slot(block_ids, position)
                    self.slots[slot] = (position, row.token_ids[position])
                    self.slot_groups[slot] = group
            row.num_computed += chunk.num_tokens
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            if chunk.needs_sample:
                row = self.rows[chunk.request_id]
                if row.num_computed != len(row.token_ids):
                    raise AssertionError(f"{chunk.request_id} samples with {row.num_computed} of "
                                         f"{len(row.token_ids)} tokens computed")
                context: list[int] = []
                for group, (window, block_ids) in enumerate(zip(self.windows, self._tables(row))):
                    first = 0 if window is None else max(0, row.num_computed - window)
                    read = [self._read(block_ids, p, group) for p in range(first, row.num_computed)]
                    context += read if window is None else [row.num_computed, *read]
                token = next_token(context)
                row.token_ids.append(token)
                sampled[chunk.request_id] = token
        self._copy_beside(output)
        return sampled

    def _tables(self, row: _FakeRow) -> list[list[int]]:
        if len(row.extra_block_ids) != len(self.windows) - 1:
            raise AssertionError(f"{len(row.extra_block_ids)} extra block tables for {len(self.windows)} groups")
        return [row.block_ids, *row.extra_block_ids]

    def _read(self, block_ids: list[int], position: int, group: int = 0) -> int:
        slot = self._slot(block_ids, position)
        stored_position, token = self.slots[slot]
        if stored_position != position:
            raise AssertionError(f"slot for position {position} holds position {stored_position}")
        if self.slot_groups.get(slot, group) != group:
            raise AssertionError(f"group {group} reads position {position} from a slot group "
                                 f"{self.slot_groups[slot]} wrote")
        return token


def block_diff(output: SchedulerOutput) -> dict[str, list[int]]:
    """The block ids the step's diff sends: a new request's whole table, a running request's new blocks."""
    diff = {new.request_id: list(new.block_ids) for new in output.new_requests}
    diff.update({running.request_id: list(running.new_block_ids) for running in output.running_requests})
    return {c.request_id: diff[c.request_id] for c in output.chunks}


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
    enable_kv_cache_events: bool = False,
    sliding_window: int | None = None,
    extra_group_windows: tuple[int | None, ...] = (),
    num_offload_blocks: int = 0,
    num_disk_offload_blocks: int = 0,
    overlap_offload_loads: bool = True,
    pace_offload_loads: bool = False,
) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                        enable_kv_cache_events=enable_kv_cache_events, sliding_window=sliding_window,
                        extra_group_windows=extra_group_windows,
                        num_offload_blocks=num_offload_blocks, num_disk_offload_blocks=num_disk_offload_blocks,
                        overlap_offload_loads=overlap_offload_loads, pace_offload_loads=pace_offload_loads)
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


class Driver:
    """The engine loop over the fake model, synchronous or pipelined (async scheduling: step N+1 is scheduled
    and run before step N's tokens reach the scheduler). Invariants are checked after every step."""

    def __init__(self, scheduler: Scheduler, model: FakePagedModel, *, pipelined: bool = False) -> None:
        self.scheduler, self.model, self.pipelined = scheduler, model, pipelined
        self._in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> SchedulerOutput:
        if not self.pipelined:
            return step(self.scheduler, self.model)[0]
        output = self.scheduler.schedule()
        sampled = self.model.run(output)  # even with no chunks: the diff may release preempted requests
        launched = (output, sampled) if output.chunks else None
        if isinstance(self.scheduler.clock, ManualClock):
            self.scheduler.clock.advance(1.0)
        if self._in_flight is not None:
            self.scheduler.update_from_output(*self._in_flight)
        self._in_flight = launched
        self.scheduler.check_integrity()
        return output


def fake_prompt(seed: int, n: int) -> list[int]:
    """A deterministic prompt of n token ids in 1..90, different for each seed."""
    return [1 + (seed * 31 + i * 7) % 90 for i in range(n)]


def add_random_mix(scheduler: Scheduler, rng: random.Random, trial: int) -> list[tuple[Request, list[int]]]:
    """Adds 3-7 requests, about half of them sharing a 12-token prefix, prompts of 1-30 more tokens, 1-25 tokens
    out; returns (request, prompt) pairs."""
    shared = fake_prompt(trial, 12)
    cases = []
    for i in range(rng.randint(3, 7)):
        prompt = (shared if rng.random() < 0.5 else []) + fake_prompt(100 * trial + i, rng.randint(1, 30))
        cases.append((make_request(f"t{trial}-{i}", prompt, max_tokens=rng.randint(1, 25)), prompt))
        scheduler.add_request(cases[-1][0])
    return cases


def evict_cached(pool: BlockPool, keys: list[int]) -> None:
    """Evicts the idle cached blocks under these keys (hashes, salted for a KV group > 0): moved to the head of
    the free queue, then taken."""
    for key in keys:
        block = pool._cached[key]
        pool.free_queue.remove(block)
        pool.free_queue.appendleft(block)
    pool.free(pool.allocate(len(keys)))


def most_running(scheduler: Scheduler, model: FakePagedModel, requests: list[Request]) -> tuple[int, int]:
    """Adds the requests and runs them to completion: (most requests running at once, preemptions)."""
    for request in requests:
        scheduler.add_request(request)
    most = 0
    driver = Driver(scheduler, model)
    while driver.busy:
        driver.step()
        most = max(most, scheduler.num_running)
    return most, scheduler.num_preemptions


def run_to_completion(
    scheduler: Scheduler, model: FakePagedModel, max_steps: int = 2000, *, pipelined: bool = False
) -> list[SchedulerOutput]:
    driver = Driver(scheduler, model, pipelined=pipelined)
    outputs: list[SchedulerOutput] = []
    while driver.busy:
        if len(outputs) >= max_steps:
            raise AssertionError(f"no completion after {max_steps} steps: the scheduler is stuck")
        outputs.append(driver.step())
    return outputs
