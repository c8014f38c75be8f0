"""ServerArgs: the HTTP-side settings of `kvpilot serve` (the engine's live in EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass


class ServerConfigError(ValueError):
    """A server flag is out of range; the message names the flag and what to change."""


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """Server settings, named like `vllm serve`'s flags where the concept is the same.

    Invariants: max_num_queued_reqs / max_num_queued_tokens are None (unbounded) or >= 1 and bound the
    requests admitted but not yet running; drain_timeout >= 0 seconds; served_model_names is non-empty
    (the first is the one reported); stats_interval > 0 seconds. engine_process: the engine core runs in its
    own process (default); False runs it in a thread of the server process (`--no-engine-process`), as does
    a factory holding weights already loaded in this process (engine_factory(args, loaded)).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("kvpilot",)
    api_key: str | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    drain_timeout: float = 30.0
    log_prompts: bool = False
    stats_interval: float = 5.0
    engine_process: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = "--" + name.replace("_", "-")
                raise ServerConfigError(f"{flag} must be >= 1 (or left out for no limit), got {value}")
        if self.drain_timeout < 0:
            raise ServerConfigError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not self.served_model_names:
            raise ServerConfigError("--served-model-name needs at least one name")
        if self.stats_interval <= 0:
            raise ServerConfigError(f"stats_interval must be > 0 seconds, got {self.stats_interval}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
