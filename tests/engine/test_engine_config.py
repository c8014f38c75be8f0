"""CacheConfig / SchedulerConfig validation: clear messages naming the setting."""

from __future__ import annotations

import pytest

from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig, check_model_len_fits


def test_defaults_follow_vllm() -> None:
    cache = CacheConfig(num_blocks=100)
    sched = SchedulerConfig(max_model_len=2048)
    assert (cache.block_size, cache.enable_prefix_caching, cache.num_tokens) == (16, True, 1600)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.scheduling_policy) == (256, 2048, "fcfs")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be >= 1"),
        ({"num_blocks": 10, "block_size": 12}, "block_size must be a power of two"),
        ({"num_blocks": 10, "block_size": 512}, "block_size must be a power of two"),
        ({"num_blocks": 10, "block_size": 0}, "block_size must be >= 1"),
        ({"num_blocks": "10"}, "num_blocks must be an integer"),
        ({"num_blocks": 10, "enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
    ],
)
def test_bad_cache_config(kwargs: dict, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"max_model_len": 64, "max_num_seqs": True}, "max_num_seqs must be an integer"),
        ({"max_model_len": 64, "max_num_batched_tokens": 8, "max_num_seqs": 16},
         r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"),
        ({"max_model_len": 64, "scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
    ],
)
def test_bad_scheduler_config(kwargs: dict, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        SchedulerConfig(**kwargs)


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=-1)


def test_model_len_must_fit_in_the_cache() -> None:
    cache = CacheConfig(num_blocks=4, block_size=16)
    check_model_len_fits(SchedulerConfig(max_model_len=64), cache)
    with pytest.raises(EngineConfigError, match="the largest max_model_len that fits is 64"):
        check_model_len_fits(SchedulerConfig(max_model_len=65), cache)
