"""The official openai SDK against the live server: both endpoints, streaming and not, greedy text equal to
LLM.generate's, usage, logprobs, and the per-request "kvpilot" timings."""

from __future__ import annotations

from kvpilot.sampling_params import SamplingParams

from tests.server.conftest import MODEL

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TIMING_KEYS = {"queue_ms", "tokenize_ms", "prefill_ms", "ttft_ms", "decode_ms", "serialize_ms", "e2e_ms"}


def _check_kvpilot_field(field: dict, num_prompt_tokens: int) -> None:
    assert field["request_id"] and field["prompt_tokens"] == num_prompt_tokens
    assert field["num_preemptions"] == 0 and field["cached_tokens"] >= 0
    t = field["timings"]
    assert set(t) == TIMING_KEYS
    assert all(v >= 0 for v in t.values())
    # The stages tile the request: tokenize + queue + prefill = ttft; ttft + decode + serialize = e2e.
    assert abs(t["tokenize_ms"] + t["queue_ms"] + t["prefill_ms"] - t["ttft_ms"]) < 0.01
    assert abs(t["ttft_ms"] + t["decode_ms"] + t["serialize_ms"] - t["e2e_ms"]) < 0.01
    assert t["prefill_ms"] > 0 and t["decode_ms"] > 0


def test_completion_matches_offline_greedy(openai_client, llm_fp32) -> None:
    expected = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0]
    raw = openai_client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                             temperature=0)
    completion = raw.parse()
    assert completion.choices[0].text == expected.outputs[0].text
    assert completion.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert completion.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    _check_kvpilot_field(completion.model_extra["kvpilot"], len(expected.prompt_token_ids))
    header = raw.headers["server-timing"]
    assert [part.split(";")[0] for part in header.split(", ")] == ["queue", "tokenize", "prefill", "decode",
                                                                   "serialize"]


def test_completion_stream_with_usage(openai_client, llm_fp32) -> None:
    expected = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0]
    chunks = list(openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    _check_kvpilot_field(last.model_extra["kvpilot"], len(expected.prompt_token_ids))
    assert all("kvpilot" not in (c.model_extra or {}) for c in chunks[:-1])


def test_chat_matches_offline_greedy(openai_client, llm_fp32) -> None:
    expected = llm_fp32.chat(QUESTION, SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert expected.outputs[0].text == "The capital of France is Paris."  # MACHINE-FACTS reference answer
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    _check_kvpilot_field(reply.model_extra["kvpilot"], len(expected.prompt_token_ids))


def test_chat_stream_without_usage_carries_timings_on_last_chunk(openai_client, llm_fp32) -> None:
    expected = llm_fp32.chat(QUESTION, SamplingParams(max_tokens=12, temperature=0.0))[0]
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None
    _check_kvpilot_field(chunks[-1].model_extra["kvpilot"], len(expected.prompt_token_ids))


def test_prefix_cache_hit_is_reported_as_cached_tokens(openai_client) -> None:
    prompt = "A long shared system prompt about geography and capitals of Europe. " * 4
    first = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    second = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # at least two full 16-token blocks
    assert second.model_extra["kvpilot"]["cached_tokens"] == second.usage.prompt_tokens_details.cached_tokens


def test_logprobs_both_shapes(openai_client, llm_fp32) -> None:
    completion = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                  logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == completion.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the likeliest alternative.
    assert lp.token_logprobs[0] == max(lp.top_logprobs[0].values())
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == reply.choices[0].message.content


def test_models_health_version(openai_client, http) -> None:
    assert [m.id for m in openai_client.models.list().data] == [MODEL, "alias"]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    alias = openai_client.completions.create(model="alias", prompt=PROMPT, max_tokens=1, temperature=0)
    assert alias.model == "alias"


def test_one_json_access_log_line_per_request_without_prompt(openai_client, caplog) -> None:
    import json
    import logging

    with caplog.at_level(logging.INFO, logger="kvpilot.access"):
        completion = openai_client.completions.create(model=MODEL, prompt="secret words", max_tokens=2,
                                                      temperature=0)
    request_id = completion.model_extra["kvpilot"]["request_id"]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvpilot.access"]
    mine = [line for line in lines if line["request_id"] == request_id]
    assert len(mine) == 1 and "prompt" not in mine[0]
    assert mine[0]["generation_tokens"] == 2 and mine[0]["status"] == 200 and mine[0]["e2e_ms"] > 0
