"""Speculative decoding (n-gram) on the real embedded model: greedy output is token-identical to decoding
without it under continuous batching, chunked prefill, prefix caching and preemption (test_batching.py's
setups, speculation on); stop strings, stop tokens and max_tokens inside accepted drafts cut where plain
decoding stops; seeded sampling gives the same tokens with and without speculation (verification.py)."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.engine_e2e.conftest import GREEDY, assert_no_leak, generate_with_steps, prefix_waves, run_alone
from tests.model.reference import PARAGRAPH, long_text

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
COPY_PROMPT = f"Repeat this passage exactly.\n\n{PARAGRAPH}\n\nRepeated passage:\n\n{PARAGRAPH[:60]}"
SECTIONS_PROMPT = long_text(2) + "Section 3. The history"  # the model copies the section it has seen twice


def _spec_llm(llm_fp32: LLM, *, always: bool = True, num_drafts: int = 4, **settings) -> LLM:
    """The fp32 weights with n-gram speculation; always: draft rows priced at nothing, so every decode with
    an n-gram match verifies drafts whatever the batch (the cost model would switch most of these off)."""
    llm = LLM(loaded=llm_fp32.loaded, speculative_config={**NGRAM, "num_speculative_tokens": num_drafts},
              **settings)
    speculator = llm.engine.scheduler.speculator
    if always:
        speculator.step_price = lambda num_running: 0.0
    return llm


@pytest.fixture(scope="module")
def sections_plain(reference_llm):
    """SECTIONS_PROMPT's 32 greedy tokens without speculation (and the text of them)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return reference_llm.generate([SECTIONS_PROMPT], params)[0].outputs[0]


def test_a_copying_prompt_accepts_drafts_and_matches_plain_decoding(llm_fp32, sections_plain):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = sections_plain.token_ids
    # the cost model as shipped: a lone stream starts out speculating (what it keeps doing depends on timings)
    shipped = _spec_llm(llm_fp32, always=False, kv_cache_memory="256MiB", max_model_len=2048)
    (output,), _ = generate_with_steps(shipped, [SECTIONS_PROMPT], params)
    assert output.outputs[0].token_ids == want and output.metrics.num_drafts > 0
    llm = _spec_llm(llm_fp32, kv_cache_memory="256MiB", max_model_len=2048)
    (output,), steps = generate_with_steps(llm, [SECTIONS_PROMPT], params)
    assert output.outputs[0].token_ids == want
    metrics = output.metrics
    assert metrics.num_accepted_tokens > 16 and metrics.draft_acceptance_rate > 0.5
    assert len(steps) < 1 + 32 - metrics.num_accepted_tokens + 1  # a step saved per accepted draft
    assert sum(s.num_accepted_tokens for s in steps) == metrics.num_accepted_tokens
    assert sum(s.num_drafts for s in steps) == metrics.num_drafts
    per_pos = [sum(s.num_accepted_tokens_per_pos[j] for s in steps if len(s.num_accepted_tokens_per_pos) > j)
               for j in range(4)]
    assert sum(per_pos) == metrics.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert_no_leak(shipped)
    assert_no_leak(llm)


# the batched setups verify 2 drafts a request: every decode of 32 computes 3 rows (time), exactness is the same
def test_32_concurrent_mixed_lengths(llm_fp32, mixed_prompts, mixed_alone):
    llm = _spec_llm(llm_fp32, num_drafts=2, enable_prefix_caching=False, kv_cache_memory="256MiB",
                    max_model_len=2048)
    outputs, steps = generate_with_steps(llm, mixed_prompts)
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone
    assert max(s.num_drafts for s in steps) > 8  # many requests verified drafts in one step
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    assert_no_leak(llm)


def test_chunked_prefill_with_small_budget(llm_fp32, mixed_prompts, mixed_alone):
    llm = _spec_llm(llm_fp32, num_drafts=2, enable_prefix_caching=False, kv_cache_memory="256MiB",
                    max_model_len=2048, max_num_batched_tokens=64, max_num_seqs=16)
    outputs, steps = generate_with_steps(llm, mixed_prompts[:16])
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone[:16]
    assert max(s.num_batched_tokens for s in steps) <= 64
    assert any(s.num_drafts and s.num_prefill_tokens for s in steps)  # verifications beside prompt chunks
    assert_no_leak(llm)


def test_second_wave_hits_the_prefix_cache(llm_fp32, corpus_ids, second_wave_alone):
    first, second = prefix_waves(corpus_ids)
    llm = _spec_llm(llm_fp32, num_drafts=2, kv_cache_memory="256MiB", max_model_len=2048)
    llm.generate(first, GREEDY)
    outputs = llm.generate(second, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == second_wave_alone
    assert [o.num_cached_tokens for o in outputs] == [144] * 5
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    assert_no_leak(llm)


def test_preemption_under_kv_pressure(llm_fp32, mixed_prompts, mixed_alone):
    llm = _spec_llm(llm_fp32, num_drafts=2, enable_prefix_caching=False, kv_cache_memory="26MiB",
                    max_model_len=512)
    outputs = llm.generate(mixed_prompts[:16], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == mixed_alone[:16]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    assert_no_leak(llm)


def test_stops_inside_accepted_drafts_cut_where_plain_decoding_does(llm_fp32, reference_llm, sections_plain):
    llm = _spec_llm(llm_fp32, kv_cache_memory="256MiB", max_model_len=2048)
    plain = sections_plain
    stop_token = plain.token_ids[17]
    cases = [SamplingParams(temperature=0, max_tokens=28, stop=[plain.text[50:56]]),
             SamplingParams(temperature=0, max_tokens=28, stop_token_ids=[stop_token], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)]
    for params in cases:
        want = reference_llm.generate([SECTIONS_PROMPT], params)[0].outputs[0]
        (got,), steps = generate_with_steps(llm, [SECTIONS_PROMPT], params)
        completion = got.outputs[0]
        assert (completion.token_ids, completion.text, completion.finish_reason, completion.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        assert len(got.metrics.inter_token_latencies) == len(completion.token_ids) - 1
        assert any(s.num_accepted_tokens for s in steps)
    assert_no_leak(llm)


def test_seeded_sampling_gives_the_same_tokens(llm_fp32, reference_llm):
    """A seeded request draws the same uniform for each output position with or without speculation, and
    verification keeps plain sampling's token there (verification.py): the outputs are equal."""
    llm = _spec_llm(llm_fp32, kv_cache_memory="256MiB", max_model_len=2048)
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=24, ignore_eos=True)
              for t, p, s in ((0.8, 0.95, 1), (0.3, 1.0, 2), (1.0, 0.9, 3))]
    outputs, steps = generate_with_steps(llm, [COPY_PROMPT] * 3, params)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [run_alone(reference_llm, [COPY_PROMPT], p)[0] for p in params]
    assert sum(s.num_accepted_tokens for s in steps) > 0
    assert_no_leak(llm)


def test_the_default_model_speculates_token_exactly():
    """LLM() as shipped (bf16 on a CPU with native bf16: the int8 decode path and fused layers): verifying rows
    run as decodes, so greedy output with speculation equals plain decoding's here too. Both prefill the three
    prompts in one step: on AMX CPUs oneDNN's bf16 prompt GEMMs round by the step's row count (docs/engine.md),
    so a prompt prefilled alone may differ from the same prompt beside others at a near tie."""
    plain = LLM(kv_cache_memory="256MiB", max_model_len=2048)
    spec = LLM(loaded=plain.loaded, kv_cache_memory="256MiB", max_model_len=2048, speculative_config=NGRAM)
    spec.engine.scheduler.speculator.step_price = lambda num_running: 0.0
    chat = plain.tokenizer.encode_chat([{"role": "user", "content": f"Repeat this passage: {PARAGRAPH}"}])
    prompts = [SECTIONS_PROMPT, COPY_PROMPT, chat]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    outputs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 16
    assert_no_leak(spec)


def test_verify_steps_through_piecewise_graphs_match_plain_decoding(llm_fp32, sections_plain):
    """A verify step (a decode and its drafts) replays the piecewise graphs' pieces on a GPU
    (model/piecewise_graphs.py; here the same breakpoints run eagerly): the tokens stay plain decoding's."""
    llm = _spec_llm(llm_fp32, kv_cache_memory="256MiB", max_model_len=2048)
    runner = llm.engine.runner
    runner.capture_piecewise_graphs([8, 16])
    rows: list[int] = []
    forward = runner.piecewise.forward
    runner.piecewise.forward = lambda ids, pos, attn, size: rows.append(len(ids)) or forward(ids, pos, attn, size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    (output,), _ = generate_with_steps(llm, [SECTIONS_PROMPT], params)
    assert output.outputs[0].token_ids == sections_plain.token_ids
    assert output.metrics.num_accepted_tokens > 16 and any(n > 1 for n in rows)  # verify steps went through them
    assert_no_leak(llm)
