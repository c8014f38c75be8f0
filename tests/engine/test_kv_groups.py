"""KV groups (engine/kv_groups.py): an interleaved model's full and sliding layers share one pool, each group
with its own block table per request. The fake model writes every token through every group's table and
samples from what each group reads (the full context, or the last W tokens), so a sliding block released while
still in its window, a block read by the wrong group, or a prefix hit missing one group's block changes the
tokens, which are compared with each prompt generated alone."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits
from kvpilot.engine.kv_events import BlockRemoved, BlockStored
from kvpilot.engine.kv_groups import MAX_KV_GROUPS, group_block_hash, plan_kv_groups
from kvpilot.engine.kv_manager import NULL_BLOCK_ID
from kvpilot.engine.request import RequestStatus
from kvpilot.engine.scheduler import Scheduler
from kvpilot.fit.kv_cache import KvCapacity

from .engine_fakes import (FakePagedModel, add_random_mix, evict_cached, fake_prompt, generate_alone, make_request,
                           make_scheduler, most_running, run_to_completion, step)

BLOCK = 4
WINDOW = 6


def _grouped(windows: tuple[int | None, ...] = (None, WINDOW), **settings: object) -> tuple[Scheduler, FakePagedModel]:
    settings.setdefault("max_model_len", 256)
    sched = make_scheduler(sliding_window=windows[0], extra_group_windows=windows[1:], **settings)  # type: ignore
    return sched, FakePagedModel(BLOCK, sched.kv.pool, windows[0], windows[1:])


def _alone(prompt: list[int], max_tokens: int, windows: tuple[int | None, ...] = (None, WINDOW)) -> list[int]:
    return generate_alone(prompt, max_tokens, windows[0], windows[1:])


# ---- the plan ------------------------------------------------------------------------------------------------


def test_uniform_models_keep_one_group_over_every_layer() -> None:
    for windows, window in (([None] * 4, None), ([4096] * 32, 4096)):  # Llama; Mistral v0.1
        plan = plan_kv_groups(windows)
        assert plan.group_windows == (window,) and not plan.is_hybrid
        assert plan.layer_slots == tuple(range(len(windows))) and plan.num_slots == len(windows)


def test_alternating_layers_make_two_groups_of_half_the_layers() -> None:
    plan = plan_kv_groups([4096, None] * 21)  # Gemma 2 9B: even layers slide
    assert plan.group_windows == (None, 4096) and plan.num_slots == 21
    assert plan.layer_groups[:4] == (1, 0, 1, 0) and plan.layer_slots[:4] == (0, 0, 1, 1)


def test_five_local_to_one_global_makes_equal_groups_and_pads_the_last() -> None:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma 3 1B: 22 local, 4 global
    plan = plan_kv_groups(windows)
    assert plan.num_slots == 4 and plan.group_windows == (None,) + (512,) * 6  # 22 local layers: 5 x 4 + 2
    pairs = list(zip(plan.layer_groups, plan.layer_slots))
    assert len(set(pairs)) == 26 and all(plan.group_windows[g] == windows[i] for i, (g, _) in enumerate(pairs))
    assert sorted(s for g, s in pairs if g == 6) == [0, 1]  # the short last group uses two of the four slots


def test_a_split_into_too_many_groups_falls_back_to_one() -> None:
    windows = [None] + [128] * 30  # one full layer among 30 sliding ones: 31 groups of one layer
    plan = plan_kv_groups(windows)
    assert MAX_KV_GROUPS < 31 and plan.group_windows == (None,) and plan.num_slots == 31


def test_keys_of_groups_differ_and_group_zero_keeps_the_hash() -> None:
    assert group_block_hash(12345, 0) == 12345
    assert len({group_block_hash(2**64 - 1, g) for g in range(MAX_KV_GROUPS)}) == MAX_KV_GROUPS
    assert all(0 <= group_block_hash(2**64 - 1, g) < 2**64 for g in range(MAX_KV_GROUPS))


# ---- capacity and admission -----------------------------------------------------------------------------------


def test_admission_counts_each_groups_blocks() -> None:
    cache = CacheConfig(num_blocks=20, block_size=BLOCK, sliding_window=None, extra_group_windows=(8,))
    # 100 tokens in chunks of 8: 25 full-group blocks, cdiv(8 - 1 + 8, 4) + 1 = 5 in the sliding group
    assert cache.max_blocks_per_request(100, 8) == 25 + 5 and cache.num_groups == 2
    with pytest.raises(EngineConfigError, match="over 2 KV groups: the largest max_model_len that fits is 60"):
        check_model_len_fits(SchedulerConfig(max_model_len=100, max_num_seqs=4, max_num_batched_tokens=8), cache)
    check_model_len_fits(SchedulerConfig(max_model_len=60, max_num_seqs=4, max_num_batched_tokens=8), cache)
    assert not CacheConfig(num_blocks=20, extra_group_windows=(8,), num_offload_blocks=4).offload_enabled


def test_fit_capacity_sums_the_groups() -> None:
    capacity = KvCapacity(num_blocks=1000, block_size=16, bytes_per_block=1, max_model_len=8192,
                          sliding_window=None, extra_group_windows=(4096,))
    assert capacity.max_concurrency == pytest.approx(1000 / (512 + 257))


# ---- the KV manager and scheduler ---------------------------------------------------------------------------


def test_the_full_group_keeps_every_block_and_the_sliding_one_its_window() -> None:
    sched, model = _grouped(num_blocks=30, max_num_batched_tokens=8)
    prompt = fake_prompt(1, 40)
    request = make_request("long", prompt, max_tokens=30)
    sched.add_request(request)
    while sched.has_unfinished_requests():
        step(sched, model)  # checks every invariant, each group's placeholders included
        if request.status is RequestStatus.RUNNING:
            table = sched.kv._tables["long"]
            assert len(request.extra_block_ids[0]) == len(request.block_ids) and table.num_null_blocks == 0
            live = len(request.block_ids) - table.extra[0].num_null_blocks
            assert live <= -(-(WINDOW - 1 + 8) // BLOCK) + 1
            assert sched.kv.pool.counts().num_used == len(request.block_ids) + live
    assert request.output_token_ids == _alone(prompt, 30)
    assert sched.kv.pool.counts().num_used == 0


def _most_running(windows: tuple[int | None, ...], num_blocks: int) -> tuple[int, int]:
    """(most requests running at once, preemptions) for 4 requests of 24 + 16 tokens."""
    sched, model = _grouped(windows, num_blocks=num_blocks, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", fake_prompt(10 + i, 24), max_tokens=16) for i in range(4)]
    counts = most_running(sched, model, requests)
    for i, request in enumerate(requests):
        assert request.output_token_ids == _alone(fake_prompt(10 + i, 24), 16, windows)
    return counts


def test_more_requests_run_at_once_than_with_one_group_of_the_same_memory() -> None:
    # two layers: one group of both (a block holds two layers) against two groups of one (a block holds one)
    grouped, single = _most_running((None, WINDOW), 56), _most_running((None,), 28)
    assert grouped == (4, 0)
    assert single[1] > 0  # the same memory in one group: the full-length tables preempt


@pytest.mark.parametrize("pipelined", [False, True])
def test_random_mixes_with_shared_prefixes_and_preemption_stay_exact(pipelined: bool) -> None:
    rng = random.Random(11 + pipelined)
    for trial in range(6):
        windows = rng.choice([(None, 3), (None, 5, 5), (None, 9), (4, 9)])
        budget = rng.choice([4, 8, 16])
        sched, model = _grouped(windows, num_blocks=rng.choice([30, 36, 48]), max_num_batched_tokens=budget,
                                max_num_seqs=4)
        cases = add_random_mix(sched, rng, trial)
        run_to_completion(sched, model, pipelined=pipelined)
        for request, prompt in cases:
            assert request.output_token_ids == _alone(prompt, request.max_tokens, windows), \
                f"trial {trial} windows {windows} budget {budget}: {request.request_id}"
        assert sched.kv.pool.counts().num_used == 0


def _cached_run(seed: int) -> tuple[Scheduler, FakePagedModel, list[int], list[int]]:
    """A scheduler whose cache holds a 24-token prompt (6 blocks) in both groups: (scheduler, model, prompt,
    the prompt's block hashes)."""
    sched, model = _grouped(num_blocks=40, max_num_batched_tokens=32)
    prompt = fake_prompt(seed, 24)
    first = make_request("first", prompt + [91], max_tokens=1)
    sched.add_request(first)
    run_to_completion(sched, model)
    return sched, model, prompt, first.block_hashes[:6]


def test_a_hit_takes_the_full_groups_blocks_and_the_sliding_groups_window() -> None:
    sched, model, prompt, hashes = _cached_run(40)
    evict_cached(sched.kv.pool, [group_block_hash(h, 1) for h in hashes[:3]])  # sliding blocks before the window
    second = make_request("second", prompt + [92, 93], max_tokens=3)
    hit = sched.kv.get_computed_blocks(second)
    # position 24 reads 19..24 in the sliding group: its blocks 4 and 5; the full group reads all six
    assert hit.num_tokens == 24 and None not in hit.blocks and len(hit.blocks) == 6
    (sliding,) = hit.extra_blocks
    assert sliding[:4] == (None,) * 4 and None not in sliding[4:]
    sched.add_request(second)
    out, _ = step(sched, model)
    (new,) = out.new_requests
    assert new.num_computed_tokens == 24 and new.extra_block_ids[0][:4] == [NULL_BLOCK_ID] * 4
    run_to_completion(sched, model)
    assert second.output_token_ids == _alone(prompt + [92, 93], 3)


@pytest.mark.parametrize(("group", "index", "num_tokens"), [(1, 4, 16), (0, 2, 8)])
def test_a_hit_stops_where_any_group_misses_a_block_it_reads(group: int, index: int, num_tokens: int) -> None:
    sched, model, prompt, hashes = _cached_run(41)
    evict_cached(sched.kv.pool, [group_block_hash(hashes[index], group)])
    second = make_request("second", prompt + [92], max_tokens=2)
    # sliding block 4 is read by hits of 5 and 6 blocks; full block 2 by every hit of more than 2
    assert sched.kv.get_computed_blocks(second).num_tokens == num_tokens
    sched.add_request(second)
    run_to_completion(sched, model)
    assert second.num_cached_tokens == num_tokens
    assert second.output_token_ids == _alone(prompt + [92], 2)


def test_kv_events_announce_group_zeros_blocks_only() -> None:
    sched, model = _grouped(num_blocks=40, max_num_batched_tokens=32, enable_kv_cache_events=True)
    request = make_request("a", fake_prompt(3, 24) + [5], max_tokens=1)
    sched.add_request(request)
    run_to_completion(sched, model)
    events = sched.kv.pool.events.take()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == request.block_hashes[:6]
    assert sched.kv.pool.cached_hashes == set(request.block_hashes[:6])
    evict_cached(sched.kv.pool, [group_block_hash(h, 1) for h in request.block_hashes[:6]])
    assert not [e for e in sched.kv.pool.events.take() if isinstance(e, BlockRemoved)]


def test_trim_cuts_every_groups_table() -> None:
    sched, _ = _grouped(num_blocks=40, max_num_batched_tokens=32)
    request = make_request("a", fake_prompt(4, 10), max_tokens=8)
    request.status = RequestStatus.RUNNING
    assert sched.kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 10
    assert sched.kv.allocate_slots(request, 6) is not None  # drafts up to 16 tokens: 4 blocks a group
    assert len(request.block_ids) == len(request.extra_block_ids[0]) == 4
    assert sched.kv.trim(request, 11) == 3
    assert len(request.block_ids) == len(request.extra_block_ids[0]) == 3
    sched.kv.check_integrity([request])
    assert sched.kv.pool.counts().num_used == 3 + 2  # the sliding group's block 0 left the window of position 10
    sched.kv.free(request)
    assert sched.kv.pool.counts().num_used == 0 and request.extra_block_ids == []
