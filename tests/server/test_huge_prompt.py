"""A huge prompt blocks nobody: prompts are tokenized in the tokenizer pool, never on the event loop, and a
prompt far over max_model_len is a clean 400 while other requests are served. No timing assertions: the
test holds the huge prompt in its worker until the other request has finished."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import kvpilot.server.serving as serving
from tests.server.conftest import MODEL
from tests.server.held_tokenizer import HeldTokenizer

HUGE_TEXT = "The quick brown fox jumps over the lazy dog; 12345 lorem ipsum. " * 16_000  # ~1 MB


@pytest.fixture()
def recording(monkeypatch) -> Iterator[HeldTokenizer]:
    held = HeldTokenizer(hold=lambda body: isinstance(getattr(body, "prompt", None), str) and
                         len(body.prompt) >= len(HUGE_TEXT))
    monkeypatch.setattr(serving, "tokenize_request", held)
    yield held
    held.release.set()


def test_tokenization_runs_off_the_event_loop(http, live_server, recording) -> None:
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert completion.status_code == 200 and chat.status_code == 200
    loop_thread = live_server._thread  # uvicorn runs the event loop in this thread
    assert len(recording.threads) == 2
    for thread in recording.threads:
        assert thread is not loop_thread and thread.name.startswith("kvpilot-tokenize")


def test_huge_prompt_is_a_clean_400_while_another_request_completes(http, live_server, recording) -> None:
    body = {"model": MODEL, "prompt": HUGE_TEXT, "max_tokens": 4}
    with ThreadPoolExecutor(1) as client_thread:
        huge = client_thread.submit(http.post, "/v1/completions", json=body)
        assert recording.held.wait(120)  # the huge prompt is now being tokenized, held there
        with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as other:
            small = other.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                        "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 8
            assert other.get("/health").status_code == 200
        assert not huge.done()
        recording.release.set()
        response = huge.result(timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "1024" in error["message"] and "the prompt has" in error["message"]
    num_tokens = int(error["message"].split("the prompt has ")[1].split(" ")[0])
    assert num_tokens > 100_000
    assert any(t.name.startswith("kvpilot-tokenize-large") for t in recording.threads)  # its own lane
