"""Randomised workloads on tiny caches, checked against each prompt run alone.

Any scheduling or block-table bug (wrong block ids, a hit on uncomputed blocks, a block freed while in use,
a lost token after preemption) changes what the paged fake model reads back, hence the generated tokens.
Invariants are checked after every step; at the end no block may be in use.
"""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.block_pool import HashFn, chained_block_hash
from kvpilot.engine.request import FinishReason, Request

from .engine_fakes import Driver, FakePagedModel, make_request, make_scheduler, next_token

EOS = 107


def _alone(prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
        if tokens[-1] == eos:
            break
    return tokens[len(prompt):]


def _workload(rng: random.Random, num_requests: int, max_prompt: int) -> list[Request]:
    prefixes = [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        tail = [rng.randrange(1, 90) for _ in range(rng.randrange(1, max_prompt))]
        prompt = (rng.choice(prefixes) + tail if rng.random() < 0.6 else tail)[:max_prompt]
        requests.append(make_request(
            f"r{i}", prompt, max_tokens=rng.randrange(1, 16), priority=rng.randrange(3),
            ignore_eos=rng.random() < 0.5,
        ))
    return requests


def _run(seed: int, policy: str, num_blocks: int, block_size: int, budget: int, abort: bool,
         hash_fn: HashFn = chained_block_hash, pipelined: bool = False) -> dict[str, int]:
    rng = random.Random(seed)
    sched = make_scheduler(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
                           max_num_seqs=min(budget, 8), max_model_len=48, policy=policy, eos_token_id=EOS,
                           hash_fn=hash_fn)
    driver = Driver(sched, FakePagedModel(block_size, sched.kv.pool), pipelined=pipelined)
    pending = _workload(rng, 30, 24)
    added: list[Request] = []
    aborted: set[str] = set()
    for _ in range(3000):
        for _ in range(rng.randrange(0, 4)):  # requests keep arriving while others run
            if pending:
                added.append(pending.pop(0))
                sched.add_request(added[-1])
        if abort and added and rng.random() < 0.05:
            victim = rng.choice(added)
            if not victim.is_finished:
                aborted.add(victim.request_id)
            sched.abort_requests([victim.request_id])
        output = driver.step()
        assert output.num_batched_tokens <= budget and len(output.chunks) <= sched.config.max_num_seqs
        # the scheduler's counts (a decode step is known by them alone) against the chunks they count
        assert output.num_batched_tokens == sum(c.num_tokens for c in output.chunks)
        assert output.num_sampled == sum(c.needs_sample for c in output.chunks)
        if output.is_all_decode:  # what the runner's decode path takes on trust
            assert all(c.is_decode and c.needs_sample for c in output.chunks)
        if not pending and not driver.busy:
            break
    assert not driver.busy, "the workload did not finish"
    for r in added:
        eos = None if r.sampling_params.ignore_eos else EOS
        expected = _alone(r.prompt_token_ids, r.max_tokens, eos)
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT
            assert r.output_token_ids == expected[:len(r.output_token_ids)]
        else:
            assert r.output_token_ids == expected, r.request_id
    counts = sched.kv.block_counts()
    assert counts.num_used == 0 and counts.num_free + counts.num_cached == num_blocks
    stats = sched.make_stats()
    return {"preemptions": stats.num_preemptions, "hits": stats.prefix_cache_hits}


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_tiny_cache_forces_preemption_and_outputs_stay_exact(policy: str, block_size: int, pipelined: bool) -> None:
    totals = {"preemptions": 0, "hits": 0}
    for seed in range(3):
        result = _run(seed, policy, num_blocks=48 // block_size + 1, block_size=block_size, budget=16, abort=False,
                      pipelined=pipelined)
        totals = {k: totals[k] + result[k] for k in totals}
    assert totals["preemptions"] > 0 and totals["hits"] > 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_roomy_cache_with_aborts_stays_consistent(seed: int, pipelined: bool) -> None:
    result = _run(seed, "fcfs", num_blocks=64, block_size=4, budget=12, abort=True, pipelined=pipelined)
    assert result["preemptions"] == 0 and result["hits"] > 0


def test_weak_hash_collisions_never_give_false_hits() -> None:
    # 32 possible hash values: collisions everywhere; the token/parent check must reject every false hit.
    result = _run(0, "fcfs", num_blocks=64, block_size=2, budget=12, abort=False,
                  hash_fn=lambda parent, tokens: chained_block_hash(parent, tokens) % 32)
    assert result["hits"] > 0


def test_many_concurrent_mixed_requests() -> None:
    sched = make_scheduler(block_size=4, num_blocks=600, max_num_batched_tokens=2048, max_num_seqs=32,
                           max_model_len=128)
    driver = Driver(sched, FakePagedModel(4, sched.kv.pool))
    rng = random.Random(7)
    requests = [make_request(f"r{i}", [rng.randrange(1, 90) for _ in range(rng.randrange(1, 80))],
                             max_tokens=rng.randrange(1, 24)) for i in range(32)]
    for r in requests:
        sched.add_request(r)
    max_running = 0
    while driver.busy:
        output = driver.step()
        max_running = max(max_running, len(output.chunks))
    assert max_running == 32  # all 32 requests share steps (continuous batching)
    assert sched.num_preemptions == 0
    for r in requests:
        assert r.output_token_ids == _alone(r.prompt_token_ids, r.max_tokens, None)
    assert sched.kv.block_counts().num_used == 0
