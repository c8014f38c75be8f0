"""Issue 43, parts 2 and 3, over HTTP (the 2-layer dummy-weight SmolLM2 server: the real HTTP stack, engine
and tokenizer): each grammar that used to fail inside an engine step (500, the step rolled back with every
request batched in it) is a 400 `invalid_request_error` naming the field and the limit, refused before it
reaches the engine; the expensive but valid ones run. Meanwhile another client's greedy stream gets exactly
the text it gets alone, and no engine step fails."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.core.served_engine import ServedEngine
from tests.server.tiny_server import MODEL, write_tiny_config

pytestmark = pytest.mark.slow

REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
REFUSED = {  # id -> (request fields, the field named, words of the message: the limit)
    "counted_repeat": ({"guided_regex": "(a{1000}){1000}"}, "guided_regex", "lexer_fuel"),
    "nested_counted_repeats": ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "lexer_fuel"),
    "regex_1mb": ({"guided_regex": "a" * 1_000_000}, "guided_regex", "max_grammar_chars"),
    "lark_3000_alternatives": ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(3000))},
                               "guided_grammar", "max_items_in_row"),
    "choice_10000": ({"guided_choice": [f"option {i}" for i in range(10_000)]}, "guided_choice",
                     "max_grammar_chars"),
    "choice_3000": ({"structured_outputs": {"choice": [f"c{i}" for i in range(3000)]}}, "structured_outputs",
                    "max_items_in_row"),
    "ref_loop": ({"guided_json": REF_LOOP}, "guided_json", "matches no output"),
    "ref_loop_response_format": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "loop", "schema": REF_LOOP}}}, "response_format", "matches no output"),
    "min_length_float": ({"guided_json": {"type": "string", "minLength": 1e9}}, "guided_json", "positive integer"),
}
EXPENSIVE = {  # valid grammars that cost seconds per token before; each token of theirs is ~0.1 ms here
    "min_length_1e9": {"guided_json": {"type": "string", "minLength": 1_000_000_000}},
    "nested_plus": {"guided_regex": "(a+)+$"},
    "min_items_1e6": {"guided_json": {"type": "array", "minItems": 1_000_000}},
}
INNOCENT = {"model": MODEL, "prompt": "The history of the printing press begins", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[BackgroundServer, list[ServedEngine]]]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    build = engine_factory(EngineArgs(model=str(config), load_format="dummy", dtype="float32", max_model_len=256,
                                      kv_cache_memory="32MiB"), warmup=False)
    engines: list[ServedEngine] = []

    def factory() -> ServedEngine:
        engines.append(build())
        return engines[-1]

    app = create_app(factory, ServerArgs(served_model_names=(MODEL,), engine_process=False))
    with BackgroundServer(app, timeout_s=120) as server:
        yield server, engines


def _stream_text(http: httpx.Client, body: dict[str, Any]) -> str:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "error" not in events[-1], events[-1]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def _completion(http: httpx.Client, fields: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", "max_tokens": 16,
                                              "temperature": 0, **fields})


def test_failing_grammars_are_400s_naming_the_limit_and_a_stream_beside_them_is_unchanged(served) -> None:
    server, engines = served
    with httpx.Client(base_url=server.url, timeout=300) as http, ThreadPoolExecutor(4) as pool:
        alone = _stream_text(http, INNOCENT)
        innocent = pool.submit(_stream_text, http, INNOCENT)
        answers = dict(zip(REFUSED, pool.map(lambda case: _completion(http, case[0]), REFUSED.values())))
        assert innocent.result() == alone
    for name, (_, param, words) in REFUSED.items():
        response = answers[name]
        assert response.status_code == 400, (name, response.text[:500])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (name, error)
        assert words in error["message"] and len(error["message"]) < 1000, (name, error["message"])
    assert engines[0].engine.num_failed_steps == 0


def test_expensive_valid_grammars_run_and_a_stream_beside_them_is_unchanged(served) -> None:
    server, engines = served
    with httpx.Client(base_url=server.url, timeout=300) as http, ThreadPoolExecutor(4) as pool:
        alone = _stream_text(http, INNOCENT)
        innocent = pool.submit(_stream_text, http, INNOCENT)
        answers = dict(zip(EXPENSIVE, pool.map(lambda fields: _completion(http, fields), EXPENSIVE.values())))
        assert innocent.result() == alone
    for name, response in answers.items():
        assert response.status_code == 200, (name, response.text[:500])
    texts = {name: response.json()["choices"][0]["text"] for name, response in answers.items()}
    assert texts["nested_plus"] and texts["nested_plus"].strip("a") == ""  # the grammar held
    assert texts["min_length_1e9"].startswith('"') and texts["min_items_1e6"].startswith("[")
    assert engines[0].engine.num_failed_steps == 0
