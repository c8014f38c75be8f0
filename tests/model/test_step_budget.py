"""The default token budget of one step follows vLLM's table (model/step_budget.py); explicit values win."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.config import EngineConfigError
from kvpilot.launch.args import EngineArgs
from kvpilot.model.step_budget import default_max_num_batched_tokens, device_class


def test_cpu_steps_take_2048_tokens_or_a_full_batch() -> None:
    cpu = torch.device("cpu")
    assert device_class(cpu) == "cpu"
    assert default_max_num_batched_tokens(cpu, 256, "llm") == default_max_num_batched_tokens(cpu, 256, "server") \
        == 2048
    assert default_max_num_batched_tokens(cpu, 4096, "server") == 4096  # every running request fits a step


def test_an_unknown_usage_context_is_refused() -> None:
    with pytest.raises(EngineConfigError, match="usage_context must be 'llm' or 'server'"):
        EngineArgs(usage_context="batch").check()


def test_the_engine_uses_the_default_unless_told(llm_fp32) -> None:
    from kvpilot import LLM

    assert llm_fp32.engine.scheduler.config.max_num_batched_tokens == 2048
    explicit = LLM(loaded=llm_fp32.loaded, max_num_batched_tokens=3000, kv_cache_memory="16MiB", max_model_len=256)
    assert explicit.engine.scheduler.config.max_num_batched_tokens == 3000
