"""`kvpilot proxy` in front of a real prefill worker and a real decode worker (issue #49 item 2): what a client
gets through the hand-off is exactly what one worker answers alone (greedy, float32, completions and chat,
streamed or not), a prefill worker's refusal reaches the client unchanged, and a client that leaves
mid-stream leaves no block used or held on either worker."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvpilot.server.disagg.proxy import ProxyConfig
from tests.server.conftest import API_KEY, authed_http
from tests.server.test_disaggregation import MODEL, _assert_idle_and_clean, _server
from tests.server.test_proxy import running_proxy

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def deployment(llm_fp32):
    """(proxy URL, prefill worker, decode worker, a worker without a kv role)."""
    with _server(llm_fp32, kv_role="prefill") as prefill, _server(llm_fp32, kv_role="decode") as decode, \
            running_proxy(ProxyConfig(prefill_urls=(prefill.url,), decode_urls=(decode.url,),
                                      max_local_prefill_tokens=0)) as url:
        yield url, prefill, decode


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


def _kvpilot_field(answer: dict) -> dict:
    return answer.get("kvpilot") or {}


def test_through_the_proxy_equals_one_worker_alone(deployment) -> None:
    url, _, decode = deployment
    body = {"model": MODEL, "prompt": _prompt(70, 1), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{decode.url}/v1/completions", json=body, headers=AUTH, timeout=120).json()
    handed = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert handed.status_code == 200, handed.text
    assert handed.headers["x-kvpilot-prefill-worker"] and handed.headers["x-kvpilot-decode-worker"] == decode.url
    answer = handed.json()
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the pulled prompt
    assert _kvpilot_field(answer).get("kv_transfer_tokens", 0) >= 64
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as stream:
        texts = [line for line in stream.iter_lines() if line.startswith("data: {")]
    import json

    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in texts if json.loads(line[6:])["choices"])
    assert streamed == alone["choices"][0]["text"]


def test_chat_through_the_proxy_equals_one_worker_alone(deployment) -> None:
    url, _, decode = deployment
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours of the rainbow, "
                                          "then say why the sky looks blue in one sentence."}],
            "max_tokens": 10, "temperature": 0}
    alone = httpx.post(f"{decode.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    handed = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    assert handed["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert _kvpilot_field(handed).get("kv_transfer_tokens", 0) > 0


def test_a_prefill_refusal_reaches_the_client_and_a_left_stream_leaves_no_block(deployment, llm_fp32) -> None:
    url, prefill, decode = deployment
    with _server(llm_fp32) as plain, running_proxy(ProxyConfig(prefill_urls=(plain.url,), decode_urls=(decode.url,),
                                                               max_local_prefill_tokens=0)) as wrong:
        refused = httpx.post(f"{wrong}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                             headers=AUTH, timeout=60)
    assert refused.status_code == 400 and "kv-role" in refused.json()["error"]["message"]
    body = {"model": MODEL, "prompt": _prompt(90, 2), "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as stream:
        for index, _ in enumerate(stream.iter_lines()):
            if index > 6:
                break  # the client leaves mid-answer
    time.sleep(0.2)
    _assert_idle_and_clean(prefill, decode)
    with authed_http(decode) as http:
        assert http.get("/health").status_code == 200


def test_a_short_prompt_is_prefilled_on_its_decode_worker(deployment) -> None:
    _, prefill, decode = deployment
    with running_proxy(ProxyConfig(prefill_urls=(prefill.url,), decode_urls=(decode.url,),
                                   max_local_prefill_tokens=64)) as url:
        body = {"model": MODEL, "prompt": _prompt(40, 3), "max_tokens": 4, "temperature": 0}
        short = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        long = httpx.post(f"{url}/v1/completions", json={**body, "prompt": _prompt(80, 4)}, headers=AUTH,
                          timeout=120)
        stats = httpx.get(f"{url}/v1/kvpilot/proxy").json()
    assert short.status_code == long.status_code == 200
    assert "x-kvpilot-prefill-worker" not in short.headers and "kv_transfer_tokens" not in _kvpilot_field(short.json())
    assert long.headers["x-kvpilot-prefill-worker"] == prefill.url
    assert stats["num_local_prefills"] == 1 and stats["num_handoffs"] == 1
