"""The run-time half of the HF-config parser: rope in both transformers layouts, norms, token ids."""

from __future__ import annotations

import pytest

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.model_catalog import get_hf_config, list_models
from kvpilot.fit.runtime_spec import RopeScaling, runtime_spec_from_hf_config


def test_llama3_rope_and_token_ids() -> None:
    spec = runtime_spec_from_hf_config(get_hf_config("llama-3.2-1b"), "llama")
    assert spec.architecture == "LlamaForCausalLM" and spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert spec.bos_token_id == 128000 and spec.eos_token_ids == (128001, 128008, 128009)


def test_transformers_5_rope_parameters() -> None:
    cfg = {k: v for k, v in get_hf_config("llama-3.2-1b").items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    spec = runtime_spec_from_hf_config(cfg)
    assert spec.rope_theta == 5e5 and spec.rope_scaling is not None and spec.rope_scaling.factor == 8.0
    plain = runtime_spec_from_hf_config({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_defaults_when_fields_are_absent() -> None:
    spec = runtime_spec_from_hf_config({})
    assert (spec.architecture, spec.rms_norm_eps, spec.rope_theta, spec.rope_scaling) == (None, 1e-6, 10000.0, None)
    assert (spec.bos_token_id, spec.eos_token_ids, spec.name_or_path) == (None, (), "")


@pytest.mark.parametrize("name", list_models())
def test_every_catalog_config_parses(name: str) -> None:
    runtime_spec_from_hf_config(get_hf_config(name), name)


def test_scaling_without_a_factor_is_named() -> None:
    with pytest.raises(ConfigError, match=r"m: rope scaling 'yarn' has no 'factor'"):
        runtime_spec_from_hf_config({"rope_scaling": {"type": "yarn"}}, "m")


def test_gemma3_states_its_scaled_context() -> None:
    """Gemma 3's max_position_embeddings (131,072) is already the scaled length of its linear factor 8; a
    Llama config with linear scaling states the pre-scaling one."""
    from kvpilot.fit.runtime_spec import RopeScaling

    linear = RopeScaling("linear", 8.0)
    assert linear.context_length(131072, "gemma3_text") == 131072
    assert linear.context_length(4096, "llama") == 32768
