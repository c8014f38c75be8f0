"""gpt-oss's harmony format through the HTTP routes: a 2-layer narrow dummy-weight SmolLM2 (tiny_server.py)
with the embedded tokenizer changed into one whose special tokens are harmony's markers (seven of its own special tokens renamed here, so the model can write them) and a
gpt-oss-like chat template ending the prompt with `<|start|>assistant`. No parser flag but
`--enable-auto-tool-choice --tool-call-parser openai`: the harmony reading is the default for such a model.
The model's text is made known by a structured-outputs Lark grammar that names the markers as special
tokens; they reach the reading although the request leaves skip_special_tokens at its default (true), and
none reaches the user."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from kvpilot import LLM
from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.openai.harmony_parser import MARKERS
from tests.server.chat_requests import chat_choice, streamed_choices
from tests.server.conftest import API_KEY, MODEL, authed_http
from tests.server.tiny_server import write_tiny_config

pytestmark = pytest.mark.slow

HARMONY_IDS = {3: "<|start|>", 4: "<|end|>", 5: "<|message|>", 6: "<|channel|>", 7: "<|constrain|>",
               8: "<|return|>", 9: "<|call|>"}
TEMPLATE = ("{%- for message in messages %}{{ '<|start|>' + message.role + '<|message|>' + message.content + "
            "'<|end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _forced(text: str) -> dict:
    """The request fields that make the model write exactly `text`: markers as special tokens, text as strings."""
    parts = [part for part in re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text) if part]
    rule = " ".join(part if part in MARKERS else json.dumps(part) for part in parts)
    return {"structured_outputs": {"grammar": f"start: {rule}"}}


def _harmony(loaded):
    """The model with its special tokens 3-9 renamed to harmony's markers, <|return|> and <|call|> ending a turn."""
    spec = json.loads(loaded.tokenizer.backend.to_str())
    vocab = spec["model"]["vocab"]
    for token in spec["added_tokens"]:
        if token["id"] in HARMONY_IDS:
            del vocab[token["content"]]
            token["content"] = HARMONY_IDS[token["id"]]
            vocab[token["content"]] = token["id"]
    tokenizer = dataclasses.replace(loaded.tokenizer, backend=BackendTokenizer.from_str(json.dumps(spec)),
                                    chat_template=TEMPLATE, eos_token_ids=(8, 9))
    return dataclasses.replace(loaded, tokenizer=tokenizer)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


START_LOG = _Lines()  # the server's start-up lines (its logger, from before the engine is ready)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = write_tiny_config(tmp_path_factory.mktemp("harmony"), narrow=True)
    settings = dict(model=str(config), load_format="dummy", dtype="float32", max_model_len=256,
                    kv_cache_memory="8MiB")
    loaded = LLM(**settings).loaded  # type: ignore[arg-type]
    args = ServerArgs(served_model_names=(MODEL,), api_key=API_KEY, engine_process=False,
                      enable_auto_tool_choice=True, tool_call_parser="openai")
    factory = engine_factory(EngineArgs(**settings), _harmony(loaded), warmup=False)  # type: ignore[arg-type]
    server_log = logging.getLogger("kvpilot.server")
    level = server_log.level
    server_log.addHandler(START_LOG)
    server_log.setLevel(logging.INFO)
    try:
        with BackgroundServer(create_app(factory, args)) as server:
            yield server
    finally:
        server_log.removeHandler(START_LOG)
        server_log.setLevel(level)


@pytest.fixture()
def client(harmony_server: BackgroundServer) -> Iterator[httpx.Client]:
    with authed_http(harmony_server) as http:
        yield http


def _chat(client: httpx.Client, **fields) -> dict:
    return chat_choice(client, {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields})


def _stream(client: httpx.Client, **fields) -> list[dict]:
    return streamed_choices(client, {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields})


def test_analysis_is_reasoning_content_and_final_the_content(client: httpx.Client) -> None:
    choice = _chat(client, **_forced(ANALYSIS + FINAL))
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user asks for the weather."
    assert message["content"] == "It is sunny." and choice["finish_reason"] == "stop"
    deltas = [c["delta"] for c in _stream(client, **_forced(ANALYSIS + FINAL))]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert "".join(reasoning) == "The user asks for the weather." and len(reasoning) > 1  # token by token
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "It is sunny." and not any(marker in content for marker in MARKERS)


def test_harmony_tool_calls_become_tool_calls(client: httpx.Client) -> None:
    choice = _chat(client, tools=TOOLS, **_forced(ANALYSIS + CALL))
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The user asks for the weather." and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    streamed = _stream(client, tools=TOOLS, **_forced(ANALYSIS + CALL))
    assert "".join(c["delta"].get("reasoning_content", "") for c in streamed) == "The user asks for the weather."
    assert not any(c["delta"].get("content") for c in streamed)
    assert streamed[-1]["finish_reason"] == "tool_calls"
    assert streamed[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_completions_keep_the_requested_detokenization(client: httpx.Client) -> None:
    """Only the chat reading turns skip_special_tokens off: a text completion's markers drop as asked."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "temperature": 0, **_forced(ANALYSIS + FINAL)}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "analysisThe user asks for the weather.assistantfinalIt is sunny."


def test_the_start_up_log_says_once_which_flags_apply(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    notes = [line for line in START_LOG.lines if "harmony format" in line]
    assert len(notes) == 1 and "--reasoning-parser openai_gptoss, on by default" in notes[0]
    assert "--tool-call-parser openai" not in notes[0]  # given: nothing to say about it
