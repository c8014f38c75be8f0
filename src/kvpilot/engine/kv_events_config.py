"""`--kv-events-config`: where the engine publishes its KV-cache events (vLLM's flag, JSON keys and defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvpilot.engine.config import EngineConfigError

PUBLISHERS = ("null", "zmq")


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher): the PUB socket binds a wildcard (`tcp://*:5557`), IPv6 (`::`), ipc://
    or inproc:// endpoint and connects to any other (`tcp://host:5557`, a subscriber that bound it: how llm-d's
    KV-cache manager collects many pods' events on one socket)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class KVEventsConfig:
    """Invariants: publisher is "null" (record nothing) or "zmq" (a PUB socket at `endpoint`, bound or connected
    as `endpoint_binds` says, each message [topic, 8-byte big-endian sequence number, msgpack batch], as vLLM
    sends); left out, it is "zmq" when events are enabled, as in vLLM. `replay_endpoint`, when set, is a ROUTER
    socket (always bound) that resends the last `buffer_steps` batches from a requested sequence number on.
    hwm >= 0 (messages a slow subscriber may queue before the PUB socket drops them); max_queue_size >= 0
    (batches waiting for the sender thread before a step waits for it; 0: no bound)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise EngineConfigError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got "
                                    f"{self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise EngineConfigError(f"kv_events_config.{name} must be an integer >= 0, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise EngineConfigError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise EngineConfigError(f"kv_events_config.replay_endpoint must be a string or null, got "
                                    f"{self.replay_endpoint!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds `endpoint` (else it connects to it)."""
        return endpoint_binds(self.endpoint)

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON, e.g. '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'.
        EngineConfigError names what is wrong."""
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
                                    f"{sorted(known)}, vLLM's keys")
        return cls(**values)
