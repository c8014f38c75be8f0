"""The engine's request-level features on the real model: settings validation, abort, stops, min_tokens,
logprobs, penalties, streaming deltas and per-request metrics."""

from __future__ import annotations

import math

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.engine.config import EngineConfigError
from kvpilot.sampling_params import SamplingParamsError
from tests.engine_e2e.conftest import assert_no_leak


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory 'lots' is not a size"),
    ({"scheduling_policy": "random"}, "scheduling_policy must be one of fcfs, priority"),
    ({"block_size": 12}, "block_size must be a power of two"),
    ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_batched_tokens \\(256\\) must be >= max_num_seqs"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in \\(0, 1\\]"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8"),
])
def test_bad_engine_settings_are_named(kwargs, message):
    with pytest.raises(EngineConfigError, match=message):
        LLM(**kwargs)


def test_unknown_setting_lists_the_allowed_ones():
    with pytest.raises(TypeError, match="unknown settings \\['max_seqs'\\]; allowed: .*max_num_seqs"):
        LLM(max_seqs=4)


def test_model_len_that_cannot_fit_names_the_largest_that_would(llm_fp32):
    with pytest.raises(EngineConfigError, match="the largest max_model_len that fits is 2912"):
        LLM(loaded=llm_fp32.loaded, kv_cache_memory="128MiB", max_model_len=4096)  # 46,080 B/token in fp32


@pytest.fixture(scope="module")
def llm(llm_fp32):
    return LLM(loaded=llm_fp32.loaded, kv_cache_memory="128MiB", max_model_len=1024)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    ids = [engine.add_request(f"Request number {i} is about", SamplingParams(max_tokens=50, ignore_eos=True))
           for i in range(3)]
    for _ in range(3):
        engine.step()
    used_before = engine.scheduler.make_stats().num_used_blocks
    engine.abort_request(ids[1])
    assert engine.scheduler.make_stats().num_used_blocks < used_before  # freed before the next step
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[ids[1]].outputs[0].finish_reason == "abort"
    assert len(finals[ids[1]].outputs[0].token_ids) < 50
    assert [finals[i].outputs[0].finish_reason for i in (ids[0], ids[2])] == ["length", "length"]
    assert_no_leak(llm)


def test_stop_string_is_excluded_and_reported(llm):
    params = SamplingParams(temperature=0, max_tokens=32, stop=["Paris"])
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)[0].outputs[0]
    assert out.text == "The capital of France is " and out.finish_reason == "stop" and out.stop_reason == "Paris"


def test_stop_token_ids_and_min_tokens(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    stop_id = greedy.token_ids[2]
    stopped = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]))[0].outputs[0]
    assert stopped.token_ids == greedy.token_ids[:3] and stopped.stop_reason == stop_id
    assert stopped.text == llm.tokenizer.decode(greedy.token_ids[:2])  # the stop token's text is not output
    longer = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40, min_tokens=len(greedy.token_ids) + 5))
    assert len(longer[0].outputs[0].token_ids) >= len(greedy.token_ids) + 5  # EOS was masked until then
    assert 2 not in longer[0].outputs[0].token_ids[: len(greedy.token_ids) + 4]


def test_logprobs_are_consistent(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(out.outputs[0].token_ids) == 6
    for token_id, entry in zip(out.outputs[0].token_ids, logprobs):
        assert entry.token_id == token_id and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0] == (token_id, pytest.approx(entry.logprob))  # greedy = the top choice
        assert entry.logprob <= 0 and sum(math.exp(lp) for _, lp in entry.top_logprobs) <= 1 + 1e-5


def test_repetition_penalty_changes_a_repetitive_continuation(llm):
    prompt = "one two one two one two one two"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    penalized = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    repetition_penalty=2.0, frequency_penalty=1.0))[0]
    assert plain.outputs[0].token_ids != penalized.outputs[0].token_ids
    assert len(set(penalized.outputs[0].token_ids)) > len(set(plain.outputs[0].token_ids))


def test_stream_deltas_and_metrics(llm):
    outputs = list(llm.stream("Write a list of fruits:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    final = outputs[-1]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.delta_text for o in outputs) == final.outputs[0].text
    m = final.metrics
    assert m.num_generated_tokens == 20 and len(m.inter_token_latencies) == 19
    assert 0 <= m.queue_time <= m.ttft and m.prefill_time > 0 and m.decode_time > 0
    assert m.e2e_latency >= m.ttft + m.decode_time - 1e-6
    assert m.num_preemptions == 0


def test_out_of_vocabulary_stop_token_with_min_tokens_fails_nothing(llm):
    """An id past the vocabulary (it once indexed out of bounds in the step, with min_tokens) is refused when
    the batch is added, with nothing queued (issue 14); the runner's min_tokens masking skips such ids too."""
    odd = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[999_999], ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
        llm.generate(["The sky is", "Hi"], [plain, odd])
    assert not llm.engine.has_unfinished_requests()


def test_vllm_prompt_dicts_are_the_same_prompts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, one or in a list, give what the plain string and ids give; a dict
    of neither kind is a TypeError naming the keys, and queues nothing."""
    greedy = SamplingParams(temperature=0, max_tokens=6)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    want = llm.generate(text, greedy)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, ids], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [want, want, want]
    assert outs[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in llm.stream({"prompt": text}, greedy)][-1] == want
    for bad in ({"prompt": text, "prompt_token_ids": ids}, {"prompt": text, "multi_modal_data": {}}, {}):
        with pytest.raises(TypeError, match="exactly one of prompt or prompt_token_ids"):
            llm.generate([text, bad], greedy)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leak(llm)
