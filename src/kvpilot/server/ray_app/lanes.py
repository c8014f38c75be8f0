"""Which lane (replica pool) serves a request: by the `X-Lane` header, else by the body's `priority`, else by
prompt length (seed 002: long and short prompts in separate lanes; interactive traffic in its own).

Invariant: `choose_lane` returns one of the config's lane names, or raises UnknownLaneError (a 400) for an
X-Lane header that names no lane; every prompt has a lane (the catch-all, or the one with the largest
max_prompt_chars when all are bounded).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvpilot.server.ray_app.config import LaneConfig

LANE_HEADER = "x-lane"


class UnknownLaneError(ValueError):
    """An X-Lane header names no lane of this application."""


def choose_lane(lanes: tuple[LaneConfig, ...], headers: Mapping[str, str], body: Any, prompt_chars: int) -> str:
    """`headers` with lower-case names; `body` the parsed JSON (anything: a non-dict has no priority)."""
    wanted = headers.get(LANE_HEADER)
    if wanted is not None:
        if not any(lane.name == wanted for lane in lanes):
            names = ", ".join(lane.name for lane in lanes)
            raise UnknownLaneError(f"X-Lane {wanted!r} names no lane of this server: use one of {names}")
        return wanted
    priority = body.get("priority") if isinstance(body, dict) else None
    if isinstance(priority, int):
        for lane in lanes:
            if priority in lane.priorities:
                return lane.name
    return lane_by_length(lanes, prompt_chars)


def lane_by_length(lanes: tuple[LaneConfig, ...], prompt_chars: int) -> str:
    """The bounded lane with the smallest max_prompt_chars that holds the prompt; else the catch-all; else
    (all bounded, prompt too long for each) the lane with the largest bound."""
    fitting = [lane for lane in lanes if lane.max_prompt_chars is not None and prompt_chars <= lane.max_prompt_chars]
    if fitting:
        return min(fitting, key=lambda lane: lane.max_prompt_chars or 0).name
    catch_all = next((lane for lane in lanes if lane.max_prompt_chars is None), None)
    if catch_all is not None:
        return catch_all.name
    return max(lanes, key=lambda lane: lane.max_prompt_chars or 0).name
