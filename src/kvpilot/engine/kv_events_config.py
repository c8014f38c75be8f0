"""`--kv-events-config`: where the engine publishes its KV-cache events (vLLM's flag and JSON keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvpilot.engine.config import EngineConfigError

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """Invariants: publisher is "null" (record nothing) or "zmq" (a PUB socket bound at `endpoint`, each
    message [topic, 8-byte big-endian sequence number, msgpack batch], as vLLM sends); hwm >= 0 (messages
    a slow subscriber may queue before the socket drops them)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise EngineConfigError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got "
                                    f"{self.publisher!r}")
        if not isinstance(self.hwm, int) or self.hwm < 0:
            raise EngineConfigError(f"kv_events_config.hwm must be an integer >= 0, got {self.hwm!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON, e.g. '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "topic": "kv-events"}'. EngineConfigError names what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineConfigError(f"--kv-events-config is not valid JSON ({exc.msg}): pass an object such as "
                                    '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'') from exc
        if not isinstance(values, dict):
            raise EngineConfigError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineConfigError(f"--kv-events-config has unsupported keys {unknown}: kvpilot reads "
                                    f"{sorted(known)} (no replay endpoint yet)")
        return cls(**values)
