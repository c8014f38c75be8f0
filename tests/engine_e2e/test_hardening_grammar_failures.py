"""Issue 43, part 2, in the engine: a grammar that gets past add_request's checks (which need no tokenizer:
the HTTP server's admission would have refused these) and fails inside a step fails its request alone. The
step does not raise, so nothing is rolled back (no failed step), and the requests batched with it get the
same tokens as when run alone. Two real failures: a Lark grammar of 3,000 alternatives goes over llguidance's
max_items_in_row once its first token is fed, and a JSON schema under a per-request mask budget (max_mask_ms)
that any token's work exceeds."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams, StructuredOutputsParams
from kvpilot.model.grammar_compiler import GrammarCompiler
from kvpilot.model.grammar_state import GrammarState
from kvpilot.outputs import RequestOutput
from kvpilot.structured_outputs.limits import GrammarLimits
from tests.engine_e2e.conftest import assert_no_leak, run_alone

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
CULPRIT = 2
LARK_3000 = "start: " + " | ".join(f'"w{i}"' for i in range(3000))
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}


def _constrained(**spec: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW, structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def prompts(mixed_prompts) -> list[list[int]]:
    return mixed_prompts[:6]


@pytest.fixture(scope="module")
def alone(reference_llm, prompts) -> list[list[int]]:
    return run_alone(reference_llm, prompts, GREEDY)


def _run_with_culprit(llm: LLM, prompts: list[list[int]], culprit: SamplingParams) -> list[RequestOutput]:
    engine = llm.engine
    ids = [engine.add_request(p, culprit if i == CULPRIT else GREEDY) for i, p in enumerate(prompts)]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.scheduler.check_integrity()
    return [finals[rid] for rid in ids]


def _check_alone(llm: LLM, outputs: list[RequestOutput], alone: list[list[int]], limit: str) -> None:
    failed = outputs[CULPRIT]
    assert failed.outputs[0].finish_reason == "error", failed.outputs[0]
    assert failed.error is not None and limit in failed.error and len(failed.error) < 1000, failed.error
    for i, output in enumerate(outputs):
        if i != CULPRIT:
            assert output.error is None and output.outputs[0].token_ids == alone[i], f"request {i} changed"
    assert llm.engine.num_failed_steps == 0  # the step never raised: nothing was rolled back
    assert_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_grammar_over_the_row_limit_fails_alone(llm_fp32, prompts, alone, async_scheduling) -> None:
    llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=2048,
              async_scheduling=async_scheduling)
    outputs = _run_with_culprit(llm, prompts, _constrained(grammar=LARK_3000))
    _check_alone(llm, outputs, alone, "max_items_in_row")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_grammar_over_the_mask_budget_fails_alone(llm_fp32, prompts, alone, async_scheduling) -> None:
    llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="256MiB", max_model_len=2048,
              async_scheduling=async_scheduling)
    runner = llm.engine.runner
    compiler = GrammarCompiler(llm_fp32.loaded.tokenizer, runner.vocab_size, runner.eos_token_ids,
                               GrammarLimits(max_mask_ms=1e-6))  # any token's work is over it
    runner.grammars = GrammarState(runner.batch.limits.max_num_seqs, compiler, runner.device)
    outputs = _run_with_culprit(llm, prompts, _constrained(json=PERSON))
    _check_alone(llm, outputs, alone, "max_mask_ms")
