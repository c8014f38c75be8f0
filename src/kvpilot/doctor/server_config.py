"""What the server was configured with, from its public interfaces: kvpilot's capacity endpoint
(``GET /v1/kvpilot/capacity``), vLLM's ``vllm:cache_config_info`` labels and block gauges, the
``max_model_len`` of ``/v1/models``, and the flags of a ``--serve`` command line.

Every field is optional: each source knows some of them, and the configuration rules check only what
is known. :func:`merge` fills gaps from later sources, so the most direct source goes first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import httpx

from kvpilot.doctor.prometheus import MetricsSnapshot
from kvpilot.fit.kv_cache import blocks_held

CAPACITY_PATH = "/v1/kvpilot/capacity"


@dataclass(frozen=True)
class ServerConfig:
    """The serving limits the doctor's configuration rules read (None: not known).

    Invariants: counts are >= 1 when set; ``num_kv_tokens`` is ``num_blocks * block_size``, divided by the KV
    groups' count for a kvpilot server whose layers form several (``kv_group_windows``: each group's sliding
    window, None for full attention; a request holds blocks in every group: ``blocks_for``); ``source`` names
    where the values came from, for evidence lines."""

    source: str
    num_blocks: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    dtype: str | None = None
    kv_cache_memory_bytes: int | None = None
    bytes_per_block: int | None = None
    fit_model: str | None = None  # the model and device as `kvpilot fit` names them (kvpilot's capacity endpoint)
    fit_device: str | None = None
    quantization: str | None = None  # how the weights are held ("none", "gguf", "int8", "int4", "fp8": kvpilot)
    weight_bits: float | None = None  # bits a weight takes as the decode reads it (kvpilot's capacity endpoint)
    engine: str | None = None  # the engine that reported these (kvpilot.doctor.engines), None: not told
    speculative_config: str | None = None  # the --speculative-config JSON a --serve command runs with
    kv_group_windows: tuple[int | None, ...] = ()

    @property
    def num_kv_tokens(self) -> int | None:
        if not self.num_blocks or not self.block_size:
            return None
        return self.num_blocks * self.block_size // max(1, len(self.kv_group_windows))

    @property
    def max_len_requests(self) -> float | None:
        """How many requests of ``max_model_len`` tokens the KV pool holds at once."""
        if len(self.kv_group_windows) > 1 and self.num_blocks and self.max_model_len:
            blocks = self.blocks_for(self.max_model_len)
            return self.num_blocks / blocks if blocks else None
        tokens = self.num_kv_tokens
        return tokens / self.max_model_len if tokens and self.max_model_len else None

    def blocks_for(self, num_tokens: float) -> int | None:
        """Blocks one request of ``num_tokens`` tokens (prompt + output) occupies (with KV groups: in all of
        them, a sliding group its window's blocks once decoding)."""
        if not self.block_size:
            return None
        windows = self.kv_group_windows if len(self.kv_group_windows) > 1 else (None,)
        return max(1, blocks_held(int(num_tokens), self.block_size, windows))

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _int(value: Any) -> int | None:
    try:
        out = int(float(value))
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def from_capacity(doc: dict[str, Any]) -> ServerConfig:
    """kvpilot's capacity JSON (older servers lack the scheduler limits: those stay None)."""
    return ServerConfig(
        source="GET " + CAPACITY_PATH, engine="kvpilot", num_blocks=_int(doc.get("num_blocks")),
        block_size=_int(doc.get("block_size")),
        max_model_len=_int(doc.get("max_model_len")), max_num_seqs=_int(doc.get("max_num_seqs")),
        max_num_batched_tokens=_int(doc.get("max_num_batched_tokens")),
        enable_prefix_caching=_bool(doc.get("enable_prefix_caching")),
        dtype=str(doc["dtype"]) if doc.get("dtype") else None,
        kv_cache_memory_bytes=_int(doc.get("kv_cache_memory_bytes")), bytes_per_block=_int(doc.get("bytes_per_block")),
        fit_model=str(doc["fit_model"]) if doc.get("fit_model") else None,
        fit_device=str(doc["fit_device"]) if doc.get("fit_device") else None,
        quantization=str(doc["quantization"]) if doc.get("quantization") else None,
        weight_bits=_float(doc.get("weight_bits")), kv_group_windows=_windows(doc.get("kv_group_windows")))


def _windows(value: Any) -> tuple[int | None, ...]:
    """The capacity JSON's kv_group_windows: () when absent or malformed (then one group is assumed)."""
    if not isinstance(value, list) or any(w is not None and _int(w) is None for w in value):
        return ()
    return tuple(None if w is None else _int(w) for w in value)


def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def from_metrics(snap: MetricsSnapshot) -> ServerConfig | None:
    """vLLM's ``vllm:cache_config_info`` (num_gpu_blocks, block_size, enable_prefix_caching), kvpilot's
    ``kvpilot:kv_cache_blocks{state="total"}`` and SGLang's ``sglang:max_total_num_tokens`` (its pool in tokens:
    blocks of one token); None when none is there."""
    info = snap.info
    blocks, block_size = _int(info.get("num_gpu_blocks")) or _int(snap.get("kv_blocks_total")), \
        _int(info.get("block_size"))
    if blocks is None and _int(snap.get("kv_tokens_total")):
        blocks, block_size = _int(snap.get("kv_tokens_total")), 1
    config = ServerConfig(source="/metrics", num_blocks=blocks, block_size=block_size,
                          enable_prefix_caching=snap.prefix_caching_enabled, engine=snap.engine)
    return config if blocks or config.enable_prefix_caching is not None else None


def from_serve_flags(argv: list[str]) -> ServerConfig:
    """The flags of a ``kvpilot serve`` / ``vllm serve`` command line (start-up facts)."""
    values: dict[str, str] = {}
    flags: set[str] = set()
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if eq:
            values[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values[name] = argv[i + 1]
        flags.add(name)
    caching = False if "no-enable-prefix-caching" in flags else True if "enable-prefix-caching" in flags else None
    return ServerConfig(source="--serve flags", max_model_len=_int(values.get("max-model-len")),
                        max_num_seqs=_int(values.get("max-num-seqs")),
                        max_num_batched_tokens=_int(values.get("max-num-batched-tokens")),
                        block_size=_int(values.get("block-size")), enable_prefix_caching=caching,
                        speculative_config=values.get("speculative-config"))


def merge(*configs: ServerConfig | None) -> ServerConfig | None:
    """The first source's values, gaps filled from the later ones; None when none is given."""
    present = [c for c in configs if c is not None]
    if not present:
        return None
    out = present[0]
    for other in present[1:]:
        gaps = {f.name: getattr(other, f.name) for f in fields(other)
                if f.name != "source" and getattr(out, f.name) is None and getattr(other, f.name) is not None}
        if gaps:
            out = replace(out, source=f"{out.source} + {other.source}", **gaps)
    return out


def fetch_capacity(base_url: str, headers: dict[str, str], timeout_s: float = 10.0) -> ServerConfig | None:
    """kvpilot's capacity endpoint; None when the server has none (vLLM, a gateway) or it fails."""
    try:
        resp = httpx.get(base_url + CAPACITY_PATH, headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        doc = resp.json()
    except (httpx.HTTPError, ValueError):
        return None
    return from_capacity(doc) if isinstance(doc, dict) and doc.get("num_blocks") else None
