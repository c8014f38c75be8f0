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
