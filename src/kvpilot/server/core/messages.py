"""The wire protocol between the HTTP side and the engine core: small, named, picklable dataclasses.

To the core (handled between steps, in order): AddRequest, Abort, Shutdown, and queries (StatsQuery,
IntegrityQuery, CapacityQuery), each answered by one QueryReply with the same `query_id`.
From the core: Ready (or LoadFailed) once at start, one StepResult per loop iteration that changed
anything, QueryReply per query, CoreFailed if the step loop itself broke.

No closures or engine objects ever cross: the same messages go through a pipe to the core process, or
through in-memory queues to the core thread (`--no-engine-process`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.engine import StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.sampling_params import SamplingParams
from kvpilot.engine.kv_transfer import KVTransferRequest
from kvpilot.server.core.engine_info import EngineInfo
from kvpilot.server.core.output_delta import OutputDelta

# ---- server -> core ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """A tokenized request. `arrival_time` is the HTTP arrival on time.monotonic, the engine's clock
    (CLOCK_MONOTONIC is system-wide, so stamps agree across the server and core processes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    kv_transfer: KVTransferRequest | None = None  # disaggregation (engine/kv_transfer.py)


@dataclass(frozen=True)
class Abort:
    """Abort requests (client gone, drain timeout); their blocks are freed before the next step."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Abort everything unfinished, send those final outputs, and end the core."""


@dataclass(frozen=True)
class StatsQuery:
    """Reply value: the scheduler's SchedulerStats now."""

    query_id: int


@dataclass(frozen=True)
class IntegrityQuery:
    """Runs the scheduler's invariant checks. Reply value: the /v1/kvpilot/integrity dict; or the error
    naming the broken invariant."""

    query_id: int


@dataclass(frozen=True)
class CapacityQuery:
    """Reply value: the live scheduler's EngineCapacity."""

    query_id: int


Query = StatsQuery | IntegrityQuery | CapacityQuery
ToCore = AddRequest | Abort | Shutdown | Query

# ---- core -> server ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Sent once, after the engine is built and warmed up. `tokenizer` (kvpilot.model.tokenizer.Tokenizer or
    None) is the engine's own, so the server tokenizes exactly as the engine detokenizes."""

    info: EngineInfo
    tokenizer: Any
    stats: SchedulerStats


@dataclass(frozen=True)
class LoadFailed:
    """Building the engine failed; `message` says what to change (bad path, out of memory...)."""

    message: str


@dataclass(frozen=True)
class StepResult:
    """One loop iteration: what the step added to each request's output (OutputDelta: new tokens, text and
    logprobs, never the whole output, so a step costs the same at token 10 and token 4,000), the StepStats of
    the step (none when nothing was scheduled), requests the engine refused (request_id, the ValueError's
    message), and the scheduler snapshot after it. A request's deltas arrive in order; its last item is a
    finished delta, a rejection or a failure (`failed`: the engine failed it alone and kept serving)."""

    outputs: list[OutputDelta] = field(default_factory=list)
    step_stats: list[StepStats] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    stats: SchedulerStats | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, error): failed alone, final


@dataclass(frozen=True)
class QueryReply:
    """The answer to the query with `query_id`: `value`, or `error` (the failure's message)."""

    query_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class CoreFailed:
    """The step loop raised: the core is gone and every unfinished request is lost."""

    message: str


FromCore = Ready | LoadFailed | StepResult | QueryReply | CoreFailed
