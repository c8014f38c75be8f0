"""Structured outputs and logit_bias through the offline API on the real embedded model: JSON schema, regex,
choice and json_object outputs match their grammar (also after preemption, under async scheduling and next
to unconstrained requests, whose greedy tokens do not change); logit_bias bans and forces tokens; a grammar
that does not compile is refused before it reaches the engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpilot import LLM, SamplingParams, StructuredOutputsParams
from kvpilot.sampling_params import MAX_TEMPERATURE, SamplingParamsError
from kvpilot.structured_outputs import StructuredOutputsError
from tests.engine_e2e.conftest import assert_no_leak

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON:", "The capital of France is", "Once upon a time", "User record:",
           "1, 2, 3,", "Here is some data about Ada Lovelace:"]


def _json(schema: dict = PERSON, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 48),
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_json_schema_outputs_validate_and_stop(llm_fp32: LLM) -> None:
    outputs = llm_fp32.generate(PROMPTS, [_json(), _json(temperature=0.8, seed=3)] * 3)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)
        assert list(json.loads(output.outputs[0].text)) == ["name", "age", "city"]  # the schema's order
    assert_no_leak(llm_fp32)


def test_regex_choice_and_json_object(llm_fp32: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
                  regex=r"[0-9]{3}-[a-z]{2,4}")),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
                  choice=["yes", "no", "maybe not"])),
              ]
    regex, choice = _texts(llm_fp32.generate(["My code is", "Is the sky green?"], params))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", regex), regex
    assert choice in ("yes", "no", "maybe not")
    obj = llm_fp32.chat([{"role": "user", "content": "What is 2+2? Answer as a JSON object like {\"answer\": 0}."}],
                        SamplingParams(temperature=0, max_tokens=40,
                                       structured_outputs=StructuredOutputsParams(json_object=True)))
    assert isinstance(json.loads(obj[0].outputs[0].text), dict), obj[0].outputs[0].text


def test_a_temperature_past_float32_still_samples_only_allowed_tokens(llm_fp32: LLM) -> None:
    """1e300 is a finite temperature, lowered to MAX_TEMPERATURE: as float32 it was inf, and a banned token's
    -inf / inf a NaN probability (the request failed on a token id past the vocabulary)."""
    params = SamplingParams(temperature=1e300, seed=4, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"]))
    assert params.temperature == MAX_TEMPERATURE
    outputs = llm_fp32.generate(["Is the sky green?"] * 3, [params] * 3)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), [o.outputs[0].finish_reason for o in outputs]
    assert set(_texts(outputs)) <= {"yes", "no", "maybe not"}, _texts(outputs)


def test_unconstrained_rows_are_unchanged_next_to_constrained_ones(llm_fp32: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _texts(llm_fp32.generate(PROMPTS[:3], plain))
    mixed = llm_fp32.generate(PROMPTS[:3] + PROMPTS[3:], [plain] * 3 + [_json()] * 3)
    assert _texts(mixed[:3]) == alone


def test_preempted_and_async_constrained_requests_still_validate(llm_fp32: LLM) -> None:
    for async_scheduling in (False, True):
        llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="10MiB", max_model_len=128, block_size=16,
                  max_num_seqs=8, async_scheduling=async_scheduling)
        prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS + PROMPTS)]
        outputs = llm.generate(prompts, [_json(max_tokens=48)] * len(prompts))
        assert llm.engine.scheduler.make_stats().num_preemptions > 0 or async_scheduling
        for output in outputs:
            assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
            jsonschema.validate(json.loads(output.outputs[0].text), PERSON)
        assert_no_leak(llm)


def test_logit_bias_bans_and_forces_tokens(llm_fp32: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    greedy = llm_fp32.generate(["The capital of France is"], plain)[0].outputs[0].token_ids
    banned = llm_fp32.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={greedy[0]: -100}))[0].outputs[0].token_ids
    assert banned[0] != greedy[0] and greedy[0] not in banned
    forced_id = llm_fp32.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = llm_fp32.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={forced_id: 100}))[0].outputs[0].token_ids
    assert forced == [forced_id] * 4


def test_bad_specs_are_refused_before_the_engine(llm_fp32: LLM) -> None:
    with pytest.raises(StructuredOutputsError, match="json"):
        llm_fp32.generate(["x"], _json({"type": "no-such-type"}))
    with pytest.raises(StructuredOutputsError, match="regex"):
        llm_fp32.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="((")))
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        _json(ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
        llm_fp32.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))
    assert_no_leak(llm_fp32)
