"""speculative_config: vLLM's keys and defaults; every bad value is an EngineConfigError naming its field."""

from __future__ import annotations

import pytest

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.launch.args import EngineArgs


def test_the_issue_example_and_vllm_defaults():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                          "prompt_lookup_min": 1})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 1, 4)
    # vLLM: neither bound given -> both 5; one given -> the other equals it
    assert SpeculativeConfig.from_dict({"method": "ngram"}).prompt_lookup_min == 5
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3



def test_a_draft_model_by_method_or_by_model_alone():
    """vLLM's two spellings; the model is loaded and checked against the target only when the engine starts."""
    by_method = SpeculativeConfig.from_dict({"method": "draft_model", "model": "org/draft-1b",
                                             "num_speculative_tokens": 3})
    assert (by_method.method, by_method.model, by_method.num_speculative_tokens) == ("draft_model", "org/draft-1b", 3)
    assert SpeculativeConfig.from_dict({"model": "/models/draft"}) == \
        SpeculativeConfig(method="draft_model", model="/models/draft")
    assert SpeculativeConfig.from_dict({"method": "ngram", "model": "org/draft-1b"}).model is None
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model is for methods draft_model, eagle, "
                                                r"eagle3; the n-gram proposer takes no model"):
        SpeculativeConfig(method="ngram", model="org/draft-1b")


def test_eagle_heads_by_method():
    """vLLM's EAGLE spellings: the head's checkpoint is read and checked against the target at start."""
    for method in ("eagle", "eagle3"):
        config = SpeculativeConfig.parse(f'{{"method": "{method}", "model": "org/head", "num_speculative_tokens": 3}}')
        assert (config.method, config.model, config.num_speculative_tokens) == (method, "org/head", 3)


@pytest.mark.parametrize("values, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "medusa"}, "method"),
    ({"method": "eagle"}, "model"),
    ({"method": "eagle3", "model": ""}, "model"),
    ({"method": "lookahead"}, "method"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "model"),
    ({"method": "draft_model", "model": ""}, "model"),
    ({"method": "ngram", "num_speculative_token": 4}, "num_speculative_token"),
])
def test_a_bad_value_names_its_field(values, field):
    with pytest.raises(EngineConfigError, match=field):
        SpeculativeConfig.from_dict(values)


def test_bad_json_and_engine_args():
    with pytest.raises(EngineConfigError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(EngineConfigError, match="JSON object"):
        SpeculativeConfig.parse("[1, 2]")
    with pytest.raises(EngineConfigError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": -1}).check()
    with pytest.raises(EngineConfigError, match="synchronous scheduling"):
        EngineArgs(speculative_config={"method": "ngram"}, async_scheduling=True).check()
    args = EngineArgs(speculative_config='{"method": "ngram", "prompt_lookup_max": 2}')
    args.check()
    assert args.speculative == SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2)
    assert EngineArgs().speculative is None
