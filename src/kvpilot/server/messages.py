"""Messages from the HTTP side to the engine thread, processed between steps (mini-sglang style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvpilot.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """A tokenized request; `arrival_time` is the HTTP arrival on time.monotonic (the engine's clock)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None


@dataclass(frozen=True)
class Abort:
    """Abort requests (client gone, drain timeout); their blocks are freed before the next step."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` in the engine thread (integrity checks, snapshots); the result goes to `reply`."""

    fn: Callable[[Any], Any]
    reply: Callable[[Any, BaseException | None], None]


@dataclass(frozen=True)
class Shutdown:
    """Abort everything unfinished and end the engine thread."""


EngineMessage = AddRequest | Abort | Call | Shutdown
