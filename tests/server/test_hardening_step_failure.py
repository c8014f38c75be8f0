"""Issue 14, part A, through the server: a request whose step raises inside the engine gets a 500 with a
message (or an SSE error event once its stream has started); the requests in flight beside it get 200 and
exactly the tokens they produce alone; the engine keeps serving, integrity holds, no block is left in use.

Every value a client can send is validated before it reaches the engine (test_hardening_validation.py), so
the failure is injected at the executor seam: a wrapper around the real model runner that raises in any
step holding a request sampled with POISON_SEED (a valid seed, so it passes validation)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import pytest

from kvpilot import SamplingParams
from kvpilot.engine.executor import Executor, StepHandle
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.core.served_engine import ServedEngine
from tests.server.conftest import server_engine_args

MODEL = "smollm2-failing"
POISON_SEED = 666
NUM_NEW = 6


class FailForSeed:
    """The executor seam, wrapped: raises inside the step (before the runner sees its diff) whenever the
    step holds a request that was admitted with POISON_SEED."""

    def __init__(self, runner: Executor) -> None:
        self.runner = runner
        self.poisoned: set[str] = set()

    def execute_model(self, output: SchedulerOutput) -> StepHandle:
        self.poisoned.update(n.request_id for n in output.new_requests if n.sampling_params.seed == POISON_SEED)
        if any(c.request_id in self.poisoned for c in output.chunks):
            raise RuntimeError("injected runner failure")
        return self.runner.execute_model(output)


def _failing_engine(build: Callable[[], ServedEngine]) -> Callable[[], ServedEngine]:
    def factory() -> ServedEngine:
        served = build()
        served.engine.runner = FailForSeed(served.engine.runner)
        return served
    return factory


@pytest.fixture(scope="module")
def server(llm_fp32) -> Iterator[BackgroundServer]:
    factory = _failing_engine(engine_factory(server_engine_args(), llm_fp32.loaded, warmup=False))
    with BackgroundServer(create_app(factory, ServerArgs(served_model_names=(MODEL,)))) as running:
        yield running


def _prompts(llm_fp32) -> list[list[int]]:
    ids = llm_fp32.tokenizer.encode("The history of the printing press begins with movable type, invented in "
                                    "China, and reaches Europe in the fifteenth century, where it changes how "
                                    "books are made, sold and read by everyone.")
    return [ids[i: i + 8 + 3 * i] for i in range(6)]


def _stream(http: httpx.Client, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return response.status_code, events


def test_one_failing_request_gets_an_error_and_the_others_their_tokens(server, llm_fp32) -> None:
    prompts = _prompts(llm_fp32)
    greedy = {"model": MODEL, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
    poisoned = {**greedy, "prompt": prompts[0], "seed": POISON_SEED}
    with httpx.Client(base_url=server.url, timeout=300) as http, ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(http.post, "/v1/completions", json={**greedy, "prompt": p}) for p in prompts]
        whole = pool.submit(http.post, "/v1/completions", json=poisoned)
        streamed = pool.submit(_stream, http, poisoned)  # 8 in flight: 6 good, 2 poisoned
        error = whole.result().json()["error"]
        assert whole.result().status_code == 500 and error["code"] == 500 and error["type"] == "request_failed"
        assert "failed when run alone" in error["message"] and "injected runner failure" in error["message"]
        status, events = streamed.result()
        assert status == 200 and events[-1]["error"]["code"] == 500
        assert "injected runner failure" in events[-1]["error"]["message"]
        responses = [f.result() for f in normal]
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        alone = [llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))[0]
                 for p in prompts]
        for response, expected in zip(responses, alone):
            assert response.json()["choices"][0]["text"] == expected.outputs[0].text
        integrity = http.get("/v1/kvpilot/integrity").json()
        assert integrity["ok"] and integrity["num_running"] == integrity["num_waiting"] == 0
        assert integrity["num_used_blocks"] == 0
        after = http.post("/v1/completions", json={**greedy, "prompt": prompts[2]})  # still serving
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone[2].outputs[0].text
