from __future__ import annotations

import pytest

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.server_capacity import compare_capacity

SERVER = {"model": "smollm2", "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
          "kv_dtype_bytes": 2, "kv_cache_memory_bytes": 2**30, "block_size": 16, "num_blocks": 2912,
          "bytes_per_block": 368_640, "max_model_len": 8192}


def test_matching_server_capacity() -> None:
    comparison = compare_capacity(SERVER)
    assert comparison.matches
    assert comparison.predicted.num_blocks == 2912
    assert ("KV tokens", 2912 * 16, 2912 * 16) in comparison.rows()


def test_mismatch_is_reported() -> None:
    comparison = compare_capacity({**SERVER, "num_blocks": 2000})
    assert not comparison.matches
    assert comparison.rows()[0] == ("KV blocks", 2912, 2000)


def test_bad_server_json() -> None:
    with pytest.raises(ConfigError, match="lacks num_blocks"):
        compare_capacity({k: v for k, v in SERVER.items() if k != "num_blocks"})
    with pytest.raises(ConfigError, match="head_dim"):
        compare_capacity({**SERVER, "head_dim": "64"})


def test_a_grouped_server_is_predicted_with_its_groups() -> None:
    """A server whose layers form KV groups (a full one and a sliding one of 3 cache layers each, 6 layers):
    its blocks span the group's layers, and a request holds blocks in both groups."""
    grouped = {**SERVER, "num_hidden_layers": 6, "num_cache_layers": 3, "kv_group_windows": [None, 512],
               "num_blocks": 2**30 // (2 * 3 * 16 * 3 * 64 * 2), "bytes_per_block": 2 * 3 * 16 * 3 * 64 * 2}
    comparison = compare_capacity(grouped)
    assert comparison.matches and comparison.predicted.bytes_per_block == 36_864  # 3 layers, not 6
    assert comparison.actual.max_concurrency == pytest.approx(grouped["num_blocks"] / (512 + 33))


def test_malformed_group_fields_are_refused() -> None:
    with pytest.raises(ConfigError, match="kv_group_windows"):
        compare_capacity({**SERVER, "kv_group_windows": [None, "512"]})
    with pytest.raises(ConfigError, match="num_cache_layers"):
        compare_capacity({**SERVER, "kv_group_windows": [None, 512], "num_cache_layers": 0})
