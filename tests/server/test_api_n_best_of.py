"""n > 1, best_of, batched prompts and echo on the live server (the real embedded model, engine core in its
own process): each choice equals the separate n = 1 request it stands for (greedy, or with the documented
seed rule seed + j), usage counts each prompt once, the sub-requests share the prompt through the prefix
cache, streams deliver every index and one [DONE], and the field rules answer 400 naming the field."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.server.metrics_text import samples, value, wait_idle

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0}


def _complete(http: httpx.Client, **body: object) -> dict:
    response = http.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _texts(reply: dict) -> list[str]:
    assert [c["index"] for c in reply["choices"]] == list(range(len(reply["choices"])))
    return [c["text"] for c in reply["choices"]]


def _unique_prompt(words: int = 40) -> str:
    """A prompt no earlier test cached (its first block differs), about `words` tokens long."""
    return f"Record {uuid.uuid4().hex[:8]}: " + " ".join(["the river runs past the old mill"] * (words // 7))


def _events(http: httpx.Client, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_greedy_n3_gives_three_copies_of_the_n1_answer(http) -> None:
    one = _complete(http, prompt=PROMPT)
    three = _complete(http, prompt=PROMPT, n=3)
    assert _texts(three) == _texts(one) * 3
    assert all(c["finish_reason"] == one["choices"][0]["finish_reason"] for c in three["choices"])
    # The prompt is counted once, the completions of all three.
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert three["usage"]["total_tokens"] == three["usage"]["prompt_tokens"] + three["usage"]["completion_tokens"]
    subs = three["kvpilot"]["sub_requests"]
    assert [s["request_id"] for s in subs] == [f"{three['id']}-{k}" for k in range(3)]


def test_sub_requests_share_the_prompt_through_the_prefix_cache(http) -> None:
    prompt = _unique_prompt()
    wait_idle(http)  # nothing left running by a test before
    before = samples(http)
    reply = _complete(http, prompt=prompt, n=3, max_tokens=2)
    after = samples(http)
    num_prompt = reply["usage"]["prompt_tokens"]
    shareable = (num_prompt - 1) // 16 * 16  # the full blocks before the last prompt token
    assert shareable >= 32
    leader, *followers = reply["kvpilot"]["sub_requests"]
    assert leader["cached_tokens"] == 0  # a new prompt: the leader computes it
    assert [f["cached_tokens"] for f in followers] == [shareable, shareable]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == shareable
    hits = value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
    assert hits >= 2 * shareable


def test_seeded_n3_choices_are_the_seed_plus_j_requests(http) -> None:
    body = {"prompt": "Once upon a time", "temperature": 1.0, "max_tokens": 8}
    three = _complete(http, n=3, seed=1234, **body)
    alone = [_texts(_complete(http, seed=1234 + j, **body))[0] for j in range(3)]
    assert _texts(three) == alone
    assert len(set(alone)) > 1  # the seeds differ, so do the samples (else the test proves nothing)
    assert _texts(_complete(http, n=3, seed=1234, **body)) == alone  # reproducible


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(http) -> None:
    body = {"prompt": "My favourite animal is", "temperature": 1.0, "max_tokens": 6, "seed": 77}
    candidates = []
    for j in range(4):
        reply = _complete(http, **{**body, "seed": 77 + j, "logprobs": 0})
        choice = reply["choices"][0]
        candidates.append((sum(choice["logprobs"]["token_logprobs"]), choice["text"]))
    ranked = [text for _, text in sorted(candidates, key=lambda c: -c[0])]
    best = _complete(http, best_of=4, n=2, **body)
    assert _texts(best) == ranked[:2]
    assert all(c["logprobs"] is None for c in best["choices"])  # asked of the engine only to rank
    assert best["usage"]["completion_tokens"] == sum(s["completion_tokens"] for s in best["kvpilot"]["sub_requests"])
    assert len(best["kvpilot"]["sub_requests"]) == 4  # every candidate was generated (and billed)
    with_logprobs = _complete(http, best_of=4, logprobs=1, **body)
    lp = with_logprobs["choices"][0]["logprobs"]
    assert _texts(with_logprobs) == ranked[:1] and len(lp["top_logprobs"][0]) == 1


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 3, "best_of": 2}, "best_of", "best_of must be >= n"),
    ({"best_of": 2, "stream": True}, "best_of", "stream"),
    ({"echo": True, "logprobs": 1}, "echo", "logprobs"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 129}, "n", "less than or equal to 128"),
    ({"n": 100, "prompt": ["a"] * 11}, "n", "engine requests"),
])
def test_fanout_rules_name_the_field(http, body: dict, param: str, words: str) -> None:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_batched_prompts_equal_separate_requests(http) -> None:
    prompts = ["The capital of France is", "Water boils at"]
    batch = _complete(http, prompt=prompts, n=2)
    alone = [_complete(http, prompt=p) for p in prompts]
    # Prompt-major: index = prompt_i * n + j.
    assert _texts(batch) == [_texts(alone[0])[0]] * 2 + [_texts(alone[1])[0]] * 2
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    ids = [[504, 3575, 282], [504, 3575, 282, 4649]]
    by_ids = _complete(http, prompt=ids)
    assert _texts(by_ids) == [_texts(_complete(http, prompt=p))[0] for p in ids]


def test_a_batch_prompt_error_names_its_index(http) -> None:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": [[1, 2], [99999999]]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt.1" and "outside the vocabulary" in error["message"]


def test_echo_prepends_the_prompt(http) -> None:
    plain = _complete(http, prompt=PROMPT)
    echoed = _complete(http, prompt=PROMPT, echo=True, n=2)
    assert _texts(echoed) == [PROMPT + _texts(plain)[0]] * 2
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = _complete(http, prompt=tokens, echo=True)
    assert _texts(by_ids)[0] == http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] + _texts(plain)[0]
    streamed = _events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "echo": True})
    text = "".join(json.loads(e)["choices"][0]["text"] for e in streamed[:-1] if json.loads(e)["choices"])
    assert text == PROMPT + _texts(plain)[0]


def test_streaming_n2_delivers_both_indexes_and_one_done(http) -> None:
    whole = _complete(http, prompt=PROMPT, n=2)
    events = _events(http, "/v1/completions", {**GREEDY, "prompt": PROMPT, "n": 2,
                                               "stream_options": {"include_usage": True}})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert [texts[0], texts[1]] == _texts(whole) and finished == {0, 1}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert "kvpilot" in chunks[-1] and all("kvpilot" not in c for c in chunks[:-1])


def test_chat_n2_whole_and_streamed(http) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    one = http.post("/v1/chat/completions", json=body).json()
    two = http.post("/v1/chat/completions", json={**body, "n": 2}).json()
    expected = one["choices"][0]["message"]["content"]
    assert [c["message"]["content"] for c in two["choices"]] == [expected] * 2
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    chunks = [json.loads(e) for e in _events(http, "/v1/chat/completions", {**body, "n": 2})[:-1]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: expected, 1: expected}


def test_client_gone_aborts_every_sub_request(http, live_server) -> None:
    body = {**GREEDY, "prompt": _unique_prompt(), "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
    wait_idle(http)  # nothing left running by a test before
    before = samples(http)
    with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            indexes: set[int] = set()
            lines = response.iter_lines()  # held: a dropped iterator closes the connection (an abort)
            for line in lines:
                if line.startswith("data: "):
                    indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(indexes) == 3:
                    break
            busy = http.get("/v1/kvpilot/integrity").json()
            assert busy["num_running"] == 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state, after = http.get("/v1/kvpilot/integrity").json(), samples(http)
        aborted = value(after, "vllm:request_success_total", finished_reason="abort") - \
            value(before, "vllm:request_success_total", finished_reason="abort")
        if state["num_running"] == 0 and state["num_used_blocks"] == 0 and aborted == 3:
            break
        time.sleep(0.05)
    assert state["ok"] and state["num_running"] == state["num_waiting"] == 0 and state["num_used_blocks"] == 0
    assert aborted == 3


@pytest.fixture(scope="module")
def failing_server(llm_fp32):
    """A server whose runner raises in any step holding a request seeded with POISON_SEED (the executor
    seam, as in test_hardening_step_failure.py): the engine fails that sub-request alone."""
    from kvpilot.server import ServerArgs, create_app, engine_factory
    from kvpilot.server.background import BackgroundServer
    from tests.server.conftest import server_engine_args
    from tests.server.test_hardening_step_failure import _failing_engine

    factory = _failing_engine(engine_factory(server_engine_args(), llm_fp32.loaded, warmup=False))
    with BackgroundServer(create_app(factory, ServerArgs(served_model_names=(MODEL,)))) as running:
        yield running


@pytest.mark.parametrize("poisoned", [0, 1])  # the leader, or a follower (candidate 1 samples with seed + 1)
def test_one_failing_sub_request_fails_the_whole_request(failing_server, poisoned: int) -> None:
    from tests.server.test_hardening_step_failure import POISON_SEED

    body = {**GREEDY, "prompt": _unique_prompt(), "n": 2, "seed": POISON_SEED - poisoned, "ignore_eos": True,
            "max_tokens": 40}
    with httpx.Client(base_url=failing_server.url, timeout=300) as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 500, whole.text
        error = whole.json()["error"]
        assert error["type"] == "request_failed" and "injected runner failure" in error["message"]
        events = _events(http, "/v1/completions", {**body, "prompt": _unique_prompt()})
        assert "[DONE]" not in events and "injected runner failure" in json.loads(events[-1])["error"]["message"]
        deadline = time.monotonic() + 30
        state = http.get("/v1/kvpilot/integrity").json()
        while (state["num_running"] or state["num_used_blocks"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            state = http.get("/v1/kvpilot/integrity").json()
        # The sibling was aborted with it: nothing runs, no block is held.
        assert state["ok"] and state["num_running"] == state["num_waiting"] == 0 and state["num_used_blocks"] == 0
        fine = http.post("/v1/completions", json={**body, "seed": POISON_SEED + 1})
        assert fine.status_code == 200 and len(fine.json()["choices"]) == 2
