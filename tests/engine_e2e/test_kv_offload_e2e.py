"""KV offload on the real model (issue #49): a returning turn whose prefix the pool had to evict gets it copied back
from the host tier (and from the disk tier below it), with greedy outputs identical to offload off, also under
preemption, and no block left in use."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.engine_e2e.conftest import assert_no_leak, generate_with_steps

pytestmark = pytest.mark.slow

GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# fp32 KV of the embedded model: 46,080 bytes a token, 737,280 a block of 16: 6MiB is a pool of 8 blocks
SMALL_POOL = dict(kv_cache_memory="6MiB", max_model_len=128, max_num_seqs=4)


def _turns(corpus_ids: list[int]) -> tuple[list[int], list[list[int]], list[int]]:
    """The first turn's prompt (60 tokens), two other sessions' prompts that fill the pool, and the second
    turn's new user tokens."""
    return corpus_ids[:60], [corpus_ids[300:400], corpus_ids[500:600]], corpus_ids[700:712]


def _conversation(llm: LLM, corpus_ids: list[int]):
    first, others, follow_up = _turns(corpus_ids)
    turn1 = llm.generate([first], GREEDY8)[0]
    for prompt in others:  # each needs 7 of the 8 blocks: the first turn's blocks are evicted
        llm.generate([prompt], GREEDY8)
    second = first + list(turn1.outputs[0].token_ids) + follow_up
    outputs, steps = generate_with_steps(llm, [second])
    return turn1, outputs[0], sum(s.num_prefill_tokens for s in steps)


@pytest.mark.parametrize("disk", [False, True])
def test_a_returning_turn_comes_back_from_the_tier_with_the_same_output(llm_fp32, corpus_ids, tmp_path, disk):
    off = LLM(loaded=llm_fp32.loaded, **SMALL_POOL)
    tiers = dict(kv_offloading_size="2MiB", kv_offload_dir=str(tmp_path), kv_offload_dir_size="16MiB") if disk \
        else dict(kv_offloading_size="64MiB")  # 2MiB: 2 host blocks, the rest goes on to disk
    on = LLM(loaded=llm_fp32.loaded, **SMALL_POOL, **tiers)
    turn1_off, second_off, recomputed_off = _conversation(off, corpus_ids)
    turn1_on, second_on, recomputed_on = _conversation(on, corpus_ids)
    assert turn1_on.outputs[0].token_ids == turn1_off.outputs[0].token_ids
    assert second_on.outputs[0].token_ids == second_off.outputs[0].token_ids
    assert second_off.num_cached_tokens == 0  # offload off: the pool had evicted every block of the first turn
    # the first turn computed 67 tokens: 4 full blocks come back from the tiers
    assert second_on.num_cached_tokens == 64 and second_on.metrics.num_tier_cached_tokens == 64
    assert recomputed_on == recomputed_off - 64
    stats = on.engine.scheduler.make_stats()
    assert stats.offload_prefix_cache_hits == 64 and stats.prefix_cache_hits == 0
    if disk:
        assert stats.num_offload_disk_loaded_blocks > 0
    assert_no_leak(on)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_turn_loading_beside_a_new_stream_keeps_both_outputs(llm_fp32, corpus_ids, overlap):
    """The second turn arrives with a new stream ahead of it: with overlap its 4 tier blocks are loaded beside
    the stream's first step and it joins at the next; without, before the step that admits both."""
    pool = dict(kv_cache_memory="9MiB", max_model_len=128, max_num_seqs=4)  # 12 blocks of 16

    def run(llm: LLM) -> tuple[list[list[int]], object]:
        first, others, follow_up = _turns(corpus_ids)
        turn1 = llm.generate([first], GREEDY8)[0]
        for prompt in others:  # the second one evicts the first turn's blocks (the oldest free ones)
            llm.generate([prompt], GREEDY8)
        second = first + list(turn1.outputs[0].token_ids) + follow_up
        outputs = llm.generate([corpus_ids[800:810], second], GREEDY8)
        return [list(o.outputs[0].token_ids) for o in outputs], outputs[1]

    expected, _ = run(LLM(loaded=llm_fp32.loaded, **pool))
    on = LLM(loaded=llm_fp32.loaded, **pool, kv_offloading_size="64MiB", kv_offload_overlap=overlap)
    outputs, second = run(on)
    assert outputs == expected
    assert second.metrics.num_tier_cached_tokens == 64
    stats = on.engine.scheduler.make_stats()
    assert stats.num_offload_loaded_blocks == 4 and stats.num_offload_overlapped_blocks == (4 if overlap else 0)
    pacer = on.engine.scheduler.kv.pacer  # CPU: the runner timed the beside copy, the pacer learned from it
    assert pacer is not None and pacer.step_seconds > 0 and (pacer.seconds_per_block is not None) == overlap
    assert_no_leak(on)


def _sessions(llm: LLM, corpus_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Four sessions at once, twice: first turns of 30 tokens (2 blocks each: the pool's 8 admit all four,
    whose decodes then need a third block each, so requests are preempted and resumed), then each returns
    with its answer and 2 more tokens, its first turn's blocks partly evicted to the tier."""
    first = [corpus_ids[40 * i:40 * i + 30] for i in range(4)]
    answers = [list(o.outputs[0].token_ids) for o in llm.generate(first, GREEDY8)]
    second = [p + a + corpus_ids[600 + 2 * i:602 + 2 * i] for i, (p, a) in enumerate(zip(first, answers))]
    return answers, [list(o.outputs[0].token_ids) for o in llm.generate(second, GREEDY8)]


def test_offload_under_preemption_keeps_outputs(llm_fp32, corpus_ids):
    off = LLM(loaded=llm_fp32.loaded, **SMALL_POOL)
    on = LLM(loaded=llm_fp32.loaded, **SMALL_POOL, kv_offloading_size="64MiB")
    assert _sessions(on, corpus_ids) == _sessions(off, corpus_ids)
    stats = on.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.offload_prefix_cache_hits > 0
    assert stats.num_offload_saved_blocks > 0 and stats.num_offload_loaded_blocks > 0
    assert_no_leak(on)
