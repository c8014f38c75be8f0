"""KV offload's bookkeeping (engine/kv_offload.py) on the paged fake model: evicted prefix blocks are saved to the
host tier (and demoted to the disk tier), a later prefix hit copies them back instead of recomputing, and the
outputs stay exactly what each prompt run alone gives, under preemption, aborts and async scheduling; the
tiers' events replay to the tiers' contents, medium by medium."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.config import CacheConfig, EngineConfigError
from kvpilot.engine.kv_events import BlockRemoved, BlockStored, KVEventLog
from kvpilot.engine.kv_offload import DISK_MEDIUM, HOST_MEDIUM, OffloadTier, OffloadTiers
from kvpilot.engine.load_pacing import FIRST_ROUND_BLOCKS, HIDE_SHARE, LoadPacer
from kvpilot.engine.request import Request

from .engine_fakes import Driver, FakePagedModel, evict_cached, generate_alone, make_request, make_scheduler, step

BLOCK = 4


# ---- the tier alone -----------------------------------------------------------------------------------


def test_a_tier_evicts_its_least_recently_used_unpinned_entry() -> None:
    tier = OffloadTier(2, HOST_MEDIUM)
    assert tier.store(10, 0, (1,)) == (0, None)
    assert tier.store(11, 10, (2,)) == (1, None)
    assert tier.store(12, 11, (3,)) is None  # both pinned in this step: nothing to evict
    tier.unpin_all()
    tier.use(10)  # 10 is now the most recently used (and pinned)
    assert tier.store(12, 11, (3,)) == (1, (11, 10, (2,), 1))  # 11 goes
    assert tier.lookup(12, 11, (3,)) == 1 and tier.lookup(12, 11, (4,)) is None  # tokens must match too
    assert tier.lookup(11, 10, (2,)) is None
    tier.unpin_all()
    tier.check_integrity()


def test_tiers_pin_what_a_step_touches_and_hand_its_orders_over_once() -> None:
    tiers = OffloadTiers(2, 2)
    tiers.save(5, 100, 0, (1,))
    tiers.save(6, 101, 100, (2,))
    tiers.save(7, 102, 101, (3,))  # the host tier is full of entries saved in this step: straight to disk
    orders = tiers.take_orders()
    assert orders is not None and orders.saves == [(5, 0), (6, 1)] and orders.disk_saves == [(7, 0)]
    assert tiers.take_orders() is None
    tiers.save(8, 103, 102, (4,))  # next step: 100 (least recently used) is demoted to disk, its slot reused
    orders = tiers.take_orders()
    assert orders is not None and orders.demotes == [(0, 1)] and orders.saves == [(8, 0)]
    hit = tiers.lookup(100, 0, (1,))
    assert hit is not None and hit.disk
    tiers.pin(hit)
    tiers.load(hit, 9)
    assert tiers.take_orders().disk_loads == [(1, 9)]  # type: ignore[union-attr]
    tiers.save(10, 104, 103, (5,))
    tiers.save(11, 105, 104, (6,))
    tiers.save(12, 106, 105, (7,))  # host and disk full of entries pinned in this step: dropped
    assert tiers.stats.num_dropped == 1
    tiers.take_orders()
    tiers.check_integrity()


def test_offload_config_is_checked() -> None:
    with pytest.raises(EngineConfigError, match="prefix caching"):
        CacheConfig(num_blocks=4, num_offload_blocks=4, enable_prefix_caching=False)
    with pytest.raises(EngineConfigError, match="host tier"):
        CacheConfig(num_blocks=4, num_disk_offload_blocks=4)
    assert not CacheConfig(num_blocks=4, num_offload_blocks=4, sliding_window=8).offload_enabled
    assert make_scheduler(num_offload_blocks=4, sliding_window=8).kv.offload is None


# ---- the scheduler with the fake model --------------------------------------------------------------


def _run_all(sched, model, requests: list[Request], pipelined: bool = False) -> dict[str, list[int]]:
    driver = Driver(sched, model, pipelined=pipelined)
    for request in requests:
        sched.add_request(request)
    steps = 0
    while driver.busy:
        driver.step()
        steps += 1
        assert steps < 2000, "stuck"
    return {r.request_id: list(r.output_token_ids) for r in requests}


def _multi_turn(num_offload_blocks: int, num_disk_offload_blocks: int = 0, fail_first: bool = False
                ) -> tuple[object, list[Request]]:
    """A first turn of 21 prompt tokens, then two other sessions that take the whole pool (8 blocks of 4),
    then the first session's second turn: its first turn's 5 full blocks were evicted from the pool."""
    rng = random.Random(3)
    sched = make_scheduler(block_size=BLOCK, num_blocks=8, max_num_batched_tokens=32, max_num_seqs=2,
                           max_model_len=32, num_offload_blocks=num_offload_blocks,
                           num_disk_offload_blocks=num_disk_offload_blocks)
    model = FakePagedModel(BLOCK, sched.kv.pool)
    first = [rng.randrange(1, 90) for _ in range(21)]
    _run_all(sched, model, [make_request("t1", first, max_tokens=3)])
    for name in ("other1", "other2"):
        _run_all(sched, model, [make_request(name, [rng.randrange(1, 90) for _ in range(25)], max_tokens=3)])
    turn1 = first + generate_alone(first, 3)
    second = make_request("t2", turn1 + [rng.randrange(1, 90) for _ in range(4)], max_tokens=4)
    if fail_first:  # the step that loads its prefix fails to launch: its copies never run
        sched.add_request(second)
        failed = sched.schedule()
        assert failed.offload is not None and failed.offload.loads
        sched.kv.discard_offload(failed.offload)
        sched.roll_back(["t2"])
        sched.check_integrity()
        outputs = _run_all(sched, model, [])
        outputs = {"t2": list(second.output_token_ids)}
    else:
        outputs = _run_all(sched, model, [second])
    assert outputs["t2"] == generate_alone(second.prompt_token_ids, 4)
    return sched, [second]


def test_a_returning_turn_loads_its_prefix_from_the_host_tier() -> None:
    without, [cold] = _multi_turn(0)
    sched, [warm] = _multi_turn(16)
    assert cold.num_cached_tokens == 0  # without offload the whole prompt is recomputed
    # the first turn computed 23 tokens (its last output token never ran): 5 full blocks, all back from the tier
    assert warm.num_cached_tokens == 20 and warm.num_tier_cached_tokens == 20
    stats = sched.make_stats()
    assert stats.offload_prefix_cache_hits == 20 and stats.num_offload_loaded_blocks == 5
    assert stats.offload_prefix_cache_queries >= 28 and stats.num_offload_saved_blocks >= 5
    assert stats.prefix_cache_hits == without.make_stats().prefix_cache_hits  # the pool's own hits apart
    assert warm.metrics().num_tier_cached_tokens == 20
    assert stats.num_used_blocks == 0


def test_a_prefix_demoted_to_disk_comes_back_from_there() -> None:
    sched, [warm] = _multi_turn(2, 16)  # a host tier of 2 blocks: the older blocks went on to disk
    stats = sched.make_stats()
    assert warm.num_tier_cached_tokens == 20
    assert stats.num_offload_disk_loaded_blocks > 0 and stats.num_offload_demoted_blocks > 0


def test_a_step_that_failed_to_launch_forgets_what_its_copies_were_to_fill() -> None:
    sched, [warm] = _multi_turn(16, fail_first=True)  # outputs checked inside: loaded again, then right
    assert sched.make_stats().num_offload_loaded_blocks == 10  # 5 blocks ordered twice
    sched.check_integrity()


def _returning_beside_a_stream(overlap: bool = True, pace: bool = False):
    """A session's first turn (21 tokens), two long prompts that evict it from the pool (12 blocks of 4) into
    the host tier, then a stream that decodes while the session's second turn arrives."""
    rng = random.Random(5)
    sched = make_scheduler(block_size=BLOCK, num_blocks=12, max_num_batched_tokens=64, max_num_seqs=4,
                           max_model_len=48, num_offload_blocks=32, overlap_offload_loads=overlap,
                           pace_offload_loads=pace)
    model = FakePagedModel(BLOCK, sched.kv.pool)
    first = [rng.randrange(1, 90) for _ in range(21)]
    _run_all(sched, model, [make_request("t1", first, max_tokens=3)])
    for name in ("other1", "other2"):
        _run_all(sched, model, [make_request(name, [rng.randrange(1, 90) for _ in range(45)], max_tokens=1)])
    stream = make_request("stream", [7, 8], max_tokens=10)
    second = make_request("t2", first + generate_alone(first, 3) + [rng.randrange(1, 90) for _ in range(4)],
                          max_tokens=4)
    sched.add_request(stream)
    step(sched, model)  # the stream runs
    sched.add_request(second)
    return sched, model, stream, second


def test_a_returning_turn_loads_beside_a_running_stream_and_joins_the_next_step() -> None:
    sched, model, stream, second = _returning_beside_a_stream()
    loading, _ = step(sched, model)
    assert [c.request_id for c in loading.chunks] == ["stream"]  # the stream's step goes on, unlengthened
    assert loading.offload is not None and len(loading.offload.beside_loads) == 5 and not loading.offload.loads
    assert loading.offload.prefetch_ids == ["t2"]
    # once its step ran, the prefetch holds nothing: its blocks wait cached and free, as any idle prefix
    assert sched.kv.num_prefetched_blocks == 0 and set(second.block_hashes[:5]) <= sched.kv.pool.cached_hashes
    assert sched.make_stats().num_used_blocks == len(stream.block_ids)
    admitted, _ = step(sched, model)  # a plain pool hit now
    assert [n.request_id for n in admitted.new_requests] == ["t2"]
    assert admitted.offload is None or not (admitted.offload.loads or admitted.offload.has_beside_loads)
    outputs = _run_all(sched, model, [])
    assert second.output_token_ids == generate_alone(second.prompt_token_ids, 4)
    assert stream.output_token_ids == generate_alone(stream.prompt_token_ids, 10) and not outputs
    assert second.num_cached_tokens == 20 and second.num_tier_cached_tokens == 20
    stats = sched.make_stats()
    assert stats.num_offload_overlapped_blocks == stats.num_offload_loaded_blocks == 5
    assert stats.offload_prefix_cache_hits == 20 and stats.num_used_blocks == 0


def _one_block_a_round(sched) -> None:
    """The pacer's model as if a block's copy took a whole step: one block a prefetch round."""
    sched.kv.pacer.seconds_per_block, sched.kv.pacer.step_seconds = 1.0, 1.0
    assert sched.kv.pacer.max_blocks() == 1


def test_a_paced_prefetch_loads_over_several_steps_beside_the_stream() -> None:
    sched, model, stream, second = _returning_beside_a_stream(pace=True)
    sched.kv.pacer.seconds_per_block, sched.kv.pacer.step_seconds = 1.0, 2.5  # 0.8 x 2.5 / 1: two a round
    rounds = []
    while not second.block_ids:
        output, _ = step(sched, model)
        assert "stream" in [c.request_id for c in output.chunks]  # the stream decodes every step
        if output.offload is not None and output.offload.has_beside_loads:
            rounds.append(len(output.offload.beside_loads))
            assert not output.offload.loads and output.offload.prefetch_ids == ["t2"]
    assert rounds == [2, 2, 1]  # the session's 5 tier blocks, then admitted from a plain pool hit
    _run_all(sched, model, [])
    assert second.output_token_ids == generate_alone(second.prompt_token_ids, 4)
    assert stream.output_token_ids == generate_alone(stream.prompt_token_ids, 10)
    assert second.num_tier_cached_tokens == 20
    stats = sched.make_stats()
    assert stats.num_offload_overlapped_blocks == stats.num_offload_loaded_blocks == 5
    assert stats.num_used_blocks == 0 and sched.kv.num_prefetched_blocks == 0


def test_a_round_whose_blocks_were_evicted_again_ends_the_prefetching() -> None:
    sched, model, stream, second = _returning_beside_a_stream(pace=True)
    _one_block_a_round(sched)
    first, _ = step(sched, model)
    # one block a round by the pacer, but a round takes at least a MAX_ROUNDS-th of the 5
    assert first.offload is not None and len(first.offload.beside_loads) == 2
    evict_cached(sched.kv.pool, second.block_hashes[:2])  # the round's blocks, idle in the pool (saved again)
    hit = sched.kv.get_computed_blocks(second)
    assert len(hit.tier_hits) == 5 and not sched.kv.can_prefetch(second, hit)  # no progress: no next round
    loading, _ = step(sched, model)
    assert "t2" in [c.request_id for c in loading.chunks]  # admitted, its blocks loaded before its step
    assert loading.offload is not None and len(loading.offload.loads) == 5 and not loading.offload.beside_loads
    _run_all(sched, model, [])
    assert second.output_token_ids == generate_alone(second.prompt_token_ids, 4)
    assert sched.make_stats().num_used_blocks == 0


def test_the_pacer_hides_a_round_behind_a_step() -> None:
    pacer = LoadPacer()
    assert pacer.max_blocks() == FIRST_ROUND_BLOCKS  # nothing measured yet: a small first round measures it
    pacer.observe(0.010, 0.0, 0)  # a 10 ms step without beside loads
    pacer.observe(0.012, 0.008, 8)  # 8 blocks copied in 8 ms beside a step
    assert pacer.max_blocks() == int(HIDE_SHARE * 0.010 / 0.001) == 8
    for _ in range(30):
        pacer.observe(0.040, 0.0, 0)  # steps grow to 40 ms (more streams): more blocks hide behind one
    assert pacer.max_blocks() == pytest.approx(32, abs=1)
    assert pacer.max_blocks(188) == 47  # never more than MAX_ROUNDS rounds' waits for a returning request
    pacer.observe(0.040, 4.0, 1)  # a very slow copy: never below one block a round
    assert pacer.max_blocks() >= 1


def test_without_overlap_the_returning_turn_loads_before_its_own_step() -> None:
    sched, model, stream, second = _returning_beside_a_stream(overlap=False)
    loading, _ = step(sched, model)
    assert sorted(c.request_id for c in loading.chunks) == ["stream", "t2"]
    assert loading.offload is not None and len(loading.offload.loads) == 5 and not loading.offload.beside_loads
    _run_all(sched, model, [])
    assert second.output_token_ids == generate_alone(second.prompt_token_ids, 4)
    assert second.num_tier_cached_tokens == 20 and sched.make_stats().num_offload_overlapped_blocks == 0


def test_a_request_aborted_while_its_prefix_loads_frees_every_block() -> None:
    sched, model, stream, second = _returning_beside_a_stream()
    loading = sched.schedule()
    assert loading.offload is not None and loading.offload.prefetch_ids == ["t2"]
    sampled = model.run(loading)
    sched.abort_requests("t2")  # between launch and read-back, as async scheduling allows
    sched.update_from_output(loading, sampled)
    sched.check_integrity()
    _run_all(sched, model, [])
    assert stream.output_token_ids == generate_alone(stream.prompt_token_ids, 10)
    stats = sched.make_stats()
    assert stats.num_used_blocks == 0 and sched.kv.num_prefetched_blocks == 0
    # the blocks its loads filled were never registered (only the tier holds the session's prefix)
    assert not set(second.block_hashes[:5]) & sched.kv.pool.cached_hashes
    assert set(second.block_hashes[:5]) <= sched.kv.offload.host.hashes


def test_a_failed_launch_gives_the_prefetch_up_and_the_turn_loads_again() -> None:
    sched, model, stream, second = _returning_beside_a_stream()
    failed = sched.schedule()
    assert failed.offload is not None and failed.offload.prefetch_ids == ["t2"]
    sched.kv.discard_offload(failed.offload)  # what the engine does when the runner raised at launch
    sched.roll_back(["stream"])
    sched.check_integrity()
    assert sched.kv.num_prefetched_blocks == 0 and not sched.kv.is_prefetching("t2")
    model.rows.pop("stream", None)  # the runner drops the rolled-back row (the engine's next diff says so)
    _run_all(sched, model, [])
    assert second.output_token_ids == generate_alone(second.prompt_token_ids, 4)
    assert stream.output_token_ids == generate_alone(stream.prompt_token_ids, 10)
    assert sched.make_stats().num_offload_loaded_blocks == 10  # ordered twice


def _workload(rng: random.Random, n: int) -> list[Request]:
    """Sessions that return with their previous prompt extended, among fresh prompts."""
    sessions = [[rng.randrange(1, 90) for _ in range(rng.randrange(5, 14))] for _ in range(4)]
    requests = []
    for i in range(n):
        if rng.random() < 0.7:
            s = rng.randrange(len(sessions))
            sessions[s] = (sessions[s] + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 6))])[-30:]
            prompt = list(sessions[s])
        else:
            prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 20))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8)))
    return requests


def _replay(events: list, held: dict[str, set[int]]) -> None:
    for event in events:
        medium = held.setdefault(event.medium, set())
        if isinstance(event, BlockStored):
            assert medium.isdisjoint(event.block_hashes), "stored twice in one medium without a removal"
            medium.update(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved) and medium.issuperset(event.block_hashes)
            medium.difference_update(event.block_hashes)


@pytest.mark.parametrize("loads", ["beside", "paced", "before"])
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("seed,host,disk", [(1, 6, 0), (2, 3, 8), (3, 12, 0), (4, 2, 2)])
def test_outputs_equal_each_prompt_alone_with_offload(seed: int, host: int, disk: int, pipelined: bool,
                                                      loads: str) -> None:
    """loads: beside another step (a prefetch), beside several steps a block a round (paced), or before the
    request's own step."""
    rng = random.Random(seed)
    overlap = loads != "before"
    sched = make_scheduler(block_size=BLOCK, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4,
                           max_model_len=40, num_offload_blocks=host, num_disk_offload_blocks=disk,
                           enable_kv_cache_events=True, overlap_offload_loads=overlap,
                           pace_offload_loads=loads == "paced")
    if loads == "paced":
        _one_block_a_round(sched)
    driver = Driver(sched, FakePagedModel(BLOCK, sched.kv.pool), pipelined=pipelined)
    pending, added, aborted = _workload(rng, 50), [], set()
    held: dict[str, set[int]] = {}
    for _ in range(5000):  # a wedged scheduler (nothing ever admitted) fails the test instead of hanging it
        if not (pending or driver.busy):
            break
        for _ in range(rng.randrange(0, 3)):
            if pending:
                added.append(pending.pop(0))
                sched.add_request(added[-1])
        if added and rng.random() < 0.04:
            victim = rng.choice(added)
            aborted.add(victim.request_id)
            sched.abort_requests(victim.request_id)
        driver.step()
        _replay(sched.kv.pool.events.take(), held)
        tiers = sched.kv.offload
        assert held.get("GPU", set()) == sched.kv.pool.cached_hashes
        assert held.get(HOST_MEDIUM, set()) == tiers.host.hashes
        assert held.get(DISK_MEDIUM, set()) == (tiers.disk.hashes if tiers.disk else set())
    assert not (pending or driver.busy), "wedged: requests left after 5000 steps"
    for request in added:
        if request.request_id not in aborted:
            expected = generate_alone(request.prompt_token_ids, request.max_tokens)
            assert request.output_token_ids == expected, request.request_id
    stats = sched.make_stats()
    assert stats.num_used_blocks == 0
    assert stats.offload_prefix_cache_hits > 0 and stats.num_preemptions > 0  # loads and preemptions happened
    if overlap and host >= 6:  # prefetches beside other requests' steps happened (tiny tiers: maybe none)
        assert stats.num_offload_overlapped_blocks > 0
    elif not overlap:
        assert stats.num_offload_overlapped_blocks == 0
    if disk:
        assert stats.num_offload_demoted_blocks > 0


def test_events_name_the_tier_and_merge_only_within_a_medium() -> None:
    log = KVEventLog(block_size=1)
    log.stored(1, None, (5,))
    log.stored(2, 1, (6,), HOST_MEDIUM)  # chains on 1, but in another medium: a new event
    log.removed(1)
    log.removed(3, HOST_MEDIUM)
    assert log.take() == [BlockStored([1], None, [5], 1), BlockStored([2], 1, [6], 1, HOST_MEDIUM),
                          BlockRemoved([1]), BlockRemoved([3], HOST_MEDIUM)]
