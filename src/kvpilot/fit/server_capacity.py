"""Predicted vs actual KV capacity of a running kvpilot server (`kvpilot fit --url`).

The contract: the JSON object a kvpilot server serves at GET /v1/kvpilot/capacity (server/core/engine_info.py
builds it; fit/cli.py fetches it), for example

    {"model": "...", "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
     "kv_dtype_bytes": 2, "kv_cache_memory_bytes": 1073741824, "block_size": 16,
     "num_blocks": 1456, "bytes_per_block": 737280, "max_model_len": 8192}

`compare_capacity` recomputes the capacity from the reported shape and KV budget with the same
function the engine allocates with, and lines it up with what the engine reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.kv_cache import KvCapacity, kv_capacity_for_memory

API_KEY_ENV = ("OPENAI_API_KEY", "KVPILOT_API_KEY")
"""Where a client of a kvpilot server (fit --url, bench, doctor) reads the key when --api-key is not given: the
OpenAI client's variable first, then the server's own."""
_REQUIRED_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "kv_dtype_bytes",
                  "kv_cache_memory_bytes", "block_size", "num_blocks", "max_model_len")


@dataclass(frozen=True)
class _Shape:
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


@dataclass(frozen=True)
class CapacityComparison:
    """Invariant: `matches` is True exactly when predicted and actual block counts are equal."""

    model: str
    predicted: KvCapacity
    actual: KvCapacity

    @property
    def matches(self) -> bool:
        return self.predicted.num_blocks == self.actual.num_blocks

    def rows(self) -> list[tuple[str, float, float]]:
        """(quantity, predicted, actual) for display."""
        p, a = self.predicted, self.actual
        return [
            ("KV blocks", p.num_blocks, a.num_blocks),
            ("KV tokens", p.num_tokens, a.num_tokens),
            ("bytes per block", p.bytes_per_block, a.bytes_per_block),
            ("max concurrency at max_model_len", round(p.max_concurrency, 2), round(a.max_concurrency, 2)),
        ]


def _group_windows(server_json: dict[str, Any]) -> tuple[int | None, ...]:
    """The KV groups' windows a kvpilot server reports (None: full attention), (None,) when it reports none."""
    windows = server_json.get("kv_group_windows") or [None]
    if not isinstance(windows, list) or any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
        raise ConfigError(f"server capacity JSON has kv_group_windows {windows!r}, not a list of windows.")
    return tuple(windows)


def compare_capacity(server_json: dict[str, Any]) -> CapacityComparison:
    """Predicted (from the reported shape and KV budget) vs actual (reported blocks).
    ConfigError when a key is missing or not a positive integer."""
    missing = [k for k in _REQUIRED_KEYS if k not in server_json]
    if missing:
        raise ConfigError(f"server capacity JSON lacks {', '.join(missing)}; is the server a kvpilot?")
    values = {k: server_json[k] for k in _REQUIRED_KEYS}
    bad = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise ConfigError(f"server capacity JSON has non-integer or negative {', '.join(bad)}.")
    shape = _Shape(values["num_hidden_layers"], values["num_key_value_heads"], values["head_dim"])
    windows = _group_windows(server_json)
    num_cache_layers = server_json.get("num_cache_layers") if len(windows) > 1 else None
    if num_cache_layers is not None and (not isinstance(num_cache_layers, int) or num_cache_layers < 1):
        raise ConfigError(f"server capacity JSON has num_cache_layers {num_cache_layers!r}, not a positive integer.")
    predicted = kv_capacity_for_memory(shape, values["kv_cache_memory_bytes"], values["block_size"],
                                       values["kv_dtype_bytes"], values["max_model_len"], windows[0], windows[1:],
                                       num_cache_layers)
    actual = KvCapacity(
        num_blocks=values["num_blocks"],
        block_size=values["block_size"],
        bytes_per_block=int(server_json.get("bytes_per_block", predicted.bytes_per_block)),
        max_model_len=values["max_model_len"],
        sliding_window=windows[0],
        extra_group_windows=windows[1:],
    )
    return CapacityComparison(str(server_json.get("model", "?")), predicted, actual)
