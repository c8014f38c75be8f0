"""The core sends each step's delta, not the whole output: the HTTP side rebuilds exactly the engine's outputs,
and what crosses per request per step does not grow with the output's length."""

from __future__ import annotations

import copy
import pickle

from kvpilot import SamplingParams
from kvpilot.server.core.output_delta import OutputAssembly, delta_of


def _snapshot(output) -> tuple:
    completion = output.outputs[0]
    return (output.request_id, output.prompt, list(output.prompt_token_ids), completion.text,
            list(completion.token_ids), completion.finish_reason, completion.stop_reason,
            copy.deepcopy(completion.logprobs), output.finished, output.num_cached_tokens, output.delta_text,
            list(output.delta_token_ids), output.metrics is not None, output.error)


def test_assembled_outputs_equal_the_engines_at_every_step(llm_fp32) -> None:
    engine = llm_fp32.engine
    prompts = {"a": "The capital of France is", "b": "Once upon a time"}
    params = {"a": SamplingParams(temperature=0, max_tokens=24, logprobs=2, stop=[" Paris", "\n\n"]),
              "b": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)}
    assemblies = {}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params[rid], request_id=f"delta-{rid}")
        assemblies[f"delta-{rid}"] = OutputAssembly(f"delta-{rid}", prompt, engine.tokenize(prompt))
    finished = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            expected = _snapshot(output)  # before the engine's next step mutates its live lists
            rebuilt = assemblies[output.request_id].add(pickle.loads(pickle.dumps(delta_of(output))))
            assert _snapshot(rebuilt) == expected
            if output.finished:
                finished.add(output.request_id)
                assert rebuilt.metrics is not None
    assert finished == {"delta-a", "delta-b"}


def test_a_delta_does_not_grow_with_the_output(llm_fp32) -> None:
    engine = llm_fp32.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=1),
                       request_id="delta-long")
    sizes = []
    while engine.has_unfinished_requests():
        sizes.extend(len(pickle.dumps(delta_of(o))) for o in engine.step() if not o.finished)
    assert len(sizes) == 99
    # the text of one token varies by a few bytes; a whole output at token 99 would be kilobytes larger (each
    # token adds its id and a logprob entry: even one byte a token would cross the bound by token 75)
    assert max(sizes[75:]) - min(sizes[:25]) < 64, (sizes[:5], sizes[-5:])
