"""KV-cache events: replaying them gives exactly the block pool's cached hashes at every step, under
prefix hits, evictions, preemptions and aborts; hashes are stable (sha256-based) and chain like the prompts."""

from __future__ import annotations

import random
import subprocess
import sys

from kvpilot.engine.block_pool import ROOT_PARENT_HASH, chained_block_hash
from kvpilot.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

from .engine_fakes import Driver, FakePagedModel, make_request, make_scheduler


def _replay(events: list, held: set[int]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == event.block_size * len(event.block_hashes)
            assert held.isdisjoint(event.block_hashes), "a hash stored twice without a removal between"
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert held.issuperset(event.block_hashes), "a hash removed that was never stored"
            held.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            held.clear()


def test_replayed_events_equal_the_pools_cached_hashes_at_every_step() -> None:
    rng = random.Random(7)
    sched = make_scheduler(block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4,
                           max_model_len=40, enable_kv_cache_events=True)
    driver = Driver(sched, FakePagedModel(4, sched.kv.pool), pipelined=True)
    prefixes = [[rng.randrange(1, 90) for _ in range(9)] for _ in range(3)]
    held: set[int] = set()
    num_removed = 0
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 14))]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 10), ignore_eos=True))
        if rng.random() < 0.1:
            sched.abort_requests([f"r{rng.randrange(i + 1)}"])
        for _ in range(rng.randrange(1, 4)):
            driver.step()
            events = sched.kv.pool.events.take()
            num_removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
            _replay(events, held)
            assert held == sched.kv.pool.cached_hashes
    while driver.busy:
        driver.step()
        _replay(sched.kv.pool.events.take(), held)
    assert held == sched.kv.pool.cached_hashes and held
    assert num_removed > 0  # evictions happened: the small cache was under pressure
    assert sched.make_stats().prefix_cache_hits > 0


def test_stored_events_chain_the_prompts_block_hashes() -> None:
    sched = make_scheduler(block_size=4, num_blocks=16, enable_kv_cache_events=True)
    driver = Driver(sched, FakePagedModel(4, sched.kv.pool))
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    while driver.busy:
        driver.step()
    stored = [e for e in sched.kv.pool.events.take() if isinstance(e, BlockStored)]
    expected, parent = [], ROOT_PARENT_HASH
    for start in range(0, 12, 4):
        parent = chained_block_hash(parent, tuple(prompt[start:start + 4]))
        expected.append(parent)
    assert [h for e in stored for h in e.block_hashes][:3] == expected
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:12] == prompt[:12]


def test_the_log_merges_a_chain_and_consecutive_removals() -> None:
    log = KVEventLog(block_size=2)
    log.stored(11, None, (1, 2))
    log.stored(12, 11, (3, 4))
    log.stored(21, 5, (7, 8))  # another sequence: a new event
    log.removed(11)
    log.removed(12)
    assert log.take() == [BlockStored([11, 12], None, [1, 2, 3, 4], 2), BlockStored([21], 5, [7, 8], 2),
                          BlockRemoved([11, 12])]
    assert log.take() == []


def test_block_hashes_are_the_same_in_another_process() -> None:
    here = chained_block_hash(ROOT_PARENT_HASH, (1, 2, 3, 4))
    code = ("from kvpilot.engine.block_pool import ROOT_PARENT_HASH, chained_block_hash;"
            "print(chained_block_hash(ROOT_PARENT_HASH, (1, 2, 3, 4)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345"}).stdout
    assert int(there) == here and 0 <= here < 2**64
