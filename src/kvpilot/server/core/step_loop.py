"""The engine core: builds the LLMEngine and runs its step loop behind an Endpoint (see messages.py).

`run_core` is the whole life of a core and is the same code in both modes: the target of the core process
(core_process.py) or of the core thread (`--no-engine-process`). Only the thread running it touches the
engine, which is not thread-safe. It sleeps on the endpoint when there is no work, handles every waiting
message between steps, and sends one StepResult per step, so a step never waits for a slow client.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Callable

from kvpilot.engine.engine import StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.omp_pool import release_omp_pool
from kvpilot.outputs import RequestOutput
from kvpilot.server.core.channel import Endpoint
from kvpilot.server.core.engine_info import EngineCapacity
from kvpilot.server.core.output_delta import delta_of
from kvpilot.server.core.pipe_channel import MessageTooLargeError
from kvpilot.server.core.messages import (Abort, AddRequest, CapacityQuery, CoreFailed, IntegrityQuery, LoadFailed,
                                     QueryReply, Ready, Shutdown, StatsQuery, StepResult, ToCore)

if TYPE_CHECKING:
    from kvpilot.engine.engine import LLMEngine
    from kvpilot.engine.kv_events_config import KVEventsConfig
    from kvpilot.engine.kv_transfer import PulledKV
    from kvpilot.server.core.kv_connector import KVConnector
    from kvpilot.server.core.kv_event_publisher import ZmqKVEventPublisher
    from kvpilot.server.core.served_engine import ServedEngine

logger = logging.getLogger("kvpilot.server")
CONNECTOR_IDLE_S = 0.005  # the loop's nap while only KV transfers are pending (no request to step)
GONE = (EOFError, BrokenPipeError, ConnectionResetError)  # the server closed its side, or died


def _integrity(engine: LLMEngine) -> dict[str, Any]:
    engine.check_integrity()
    stats = engine.stats()
    return {"ok": True, "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "num_used_blocks": stats.num_used_blocks, "num_free_blocks": stats.num_free_blocks,
            "num_cached_blocks": stats.num_cached_blocks, "num_total_blocks": stats.num_total_blocks,
            "num_held_blocks": engine.scheduler.kv.num_held_blocks}  # disaggregation: kept for a decode worker


def _capacity(engine: LLMEngine) -> EngineCapacity:
    cache, config = engine.cache_config, engine.scheduler_config
    return EngineCapacity(num_blocks=cache.num_blocks, block_size=cache.block_size,
                          max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens)


def _stats(engine: LLMEngine) -> SchedulerStats:
    return engine.stats()


QUERIES: dict[type, Callable[[Any], Any]] = {
    StatsQuery: _stats,
    IntegrityQuery: _integrity,
    CapacityQuery: _capacity,
}


class EngineCore:
    """The step loop. Invariants: every AddRequest gets exactly one final item back (a finished output or a
    rejection) unless the core dies; every query exactly one QueryReply; messages are handled in the order
    sent, between steps; a StepResult is sent whenever outputs, step stats or the scheduler snapshot changed."""

    def __init__(self, engine: LLMEngine, endpoint: Endpoint, kv_events: ZmqKVEventPublisher | None = None,
                 kv_connector: KVConnector | None = None) -> None:
        """`kv_events` gets the block pool's KV-cache events after every step (the pool records them only when
        the engine was built with them enabled); `kv_connector` moves KV between disaggregated workers
        (kv_connector.py): the loop ticks it between steps."""
        self.engine, self.endpoint, self.kv_events = engine, endpoint, kv_events
        self.kv_connector = kv_connector
        self._live: set[str] = set()  # added and not yet finished: what Shutdown aborts
        self._step_stats: list[StepStats] = []
        self._rejected: list[tuple[str, str]] = []
        engine.on_step = self._step_stats.append  # collected per step, sent with the step's outputs
        self.stats: SchedulerStats = self._engine_stats()

    def _engine_stats(self) -> SchedulerStats:
        stats = self.engine.stats()
        if self.kv_connector is not None:
            stats = dataclasses.replace(stats, **self.kv_connector.stats_fields())
        return stats

    def run(self) -> None:
        """Serves until Shutdown; raises EOFError/OSError when the server side is gone."""
        while True:
            idle = not self.engine.has_unfinished_requests()
            connector = self.kv_connector
            if not self._handle(self._receive(block=idle and (connector is None or not connector.busy))):
                return
            if connector is not None:
                self._tick(connector)
            self._step_and_publish()

    def _receive(self, block: bool) -> list[ToCore]:
        if block:
            # An idle core's OpenMP workers would count against every other thread's in this process (an engine
            # core in a thread beside others: tests, Ray replicas): past one per CPU libgomp stops spinning and
            # each parallel region waits on a wake-up (omp_pool.py). The next step builds a new pool.
            release_omp_pool()
        messages = [self.endpoint.recv()] if block else []  # sleep when idle
        while self.endpoint.poll():
            messages.append(self.endpoint.recv())
        if not block and not messages and not self.engine.has_unfinished_requests():
            time.sleep(CONNECTOR_IDLE_S)  # only KV transfers pending: wait for them without spinning
        return messages

    def _tick(self, connector: KVConnector) -> None:
        """Frees held blocks whose pull ended or expired; adds the requests whose KV pull ended (with the pulled
        K/V, or to recompute it after a transport failure); a refused pull fails its request alone, a cancelled
        one (aborted meanwhile) ends as rejected too, nothing allocated for it."""
        for message, result in connector.tick():
            if isinstance(result, str):
                self._live.discard(message.request_id)
                self._rejected.append((message.request_id, result or "aborted while its KV was being pulled"))
            else:
                self._add(message, result, pulled=True)

    def _handle(self, messages: list[ToCore]) -> bool:
        """Processes the messages in order; False on Shutdown (after aborting and publishing what was live)."""
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, Abort):
                ids = list(message.request_ids)
                pulling = self.kv_connector.cancel(ids) if self.kv_connector is not None else []
                self.engine.abort_request([rid for rid in ids if rid not in pulling])
            elif isinstance(message, Shutdown):
                if self.kv_connector is not None:  # pulls in flight: their requests end now, as rejected
                    for rid in self.kv_connector.cancel(sorted(self._live)):
                        self._live.discard(rid)
                        self._rejected.append((rid, "the server is shutting down"))
                self.engine.abort_request(sorted(self._live))
                self._step_and_publish()
                return False
            else:
                self.endpoint.send(self._answer(message))
        return True

    def _add(self, message: AddRequest, remote_kv: PulledKV | None = None, pulled: bool = False) -> None:
        transfer = message.kv_transfer
        if transfer is not None and transfer.source is not None and not pulled:
            if self.kv_connector is None:
                self._rejected.append((message.request_id, "kv_transfer_params.do_remote_prefill needs a worker "
                                                            "started with --kv-role decode or both"))
                return
            self.kv_connector.start_pull(message, transfer.source)  # added once its KV is here (_tick)
            self._live.add(message.request_id)
            return
        try:
            self.engine.add_request(message.prompt, message.params, request_id=message.request_id,
                                    priority=message.priority, arrival_time=message.arrival_time,
                                    prompt_token_ids=message.prompt_token_ids, kv_transfer=transfer,
                                    remote_kv=remote_kv)
            self._live.add(message.request_id)
        except ValueError as exc:  # too long for the cache, duplicate id: the request's own fault
            self._rejected.append((message.request_id, str(exc)))

    def _answer(self, query: Any) -> QueryReply:
        handler = QUERIES.get(type(query))
        if handler is None:
            return QueryReply(getattr(query, "query_id", -1), error=f"unknown message {type(query).__name__}")
        try:
            return QueryReply(query.query_id, handler(self.engine))
        except Exception as exc:  # noqa: BLE001 - the reply carries it to the caller
            return QueryReply(query.query_id, error=str(exc) or type(exc).__name__)

    def _step_and_publish(self) -> None:
        outputs: list[RequestOutput] = self.engine.step() if self.engine.has_unfinished_requests() else []
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.take_kv_events())
        self._live.difference_update(o.request_id for o in outputs if o.finished)
        if self.kv_connector is not None:
            self.kv_connector.register(outputs)
        failed = [(o.request_id, o.error) for o in outputs if o.error is not None]
        if failed:  # failed alone by the engine (engine/step_failures.py): their clients get the error
            outputs = [o for o in outputs if o.error is None]
        # Snapshot before sending: a client that got its final output then scrapes sees the state after.
        stats = self._engine_stats()
        changed = stats != self.stats  # unchanged stats stay off the wire: the HTTP side keeps the last ones
        if outputs or failed or self._step_stats or self._rejected or changed:
            self._send_step(StepResult([delta_of(o) for o in outputs], list(self._step_stats),
                                       list(self._rejected), stats if changed else None, failed))
        self.stats = stats
        self._step_stats.clear()
        self._rejected.clear()

    def _send_step(self, result: StepResult) -> None:
        try:
            self.endpoint.send(result)
        except MessageTooLargeError:
            self._send_apart(result)

    def _send_apart(self, result: StepResult) -> None:
        """A StepResult over the channel's size limit (long prompts' prompt_logprobs in one step): the rest of
        it first, then each output alone; an output still over the limit fails its request alone."""
        self.endpoint.send(StepResult([], result.step_stats, result.rejected, result.stats, result.failed))
        for delta in result.outputs:
            try:
                self.endpoint.send(StepResult([delta]))
            except MessageTooLargeError as exc:
                self.engine.abort_request([delta.request_id])
                self._live.discard(delta.request_id)
                self.endpoint.send(StepResult(failed=[(delta.request_id, f"this request's output is too large to "
                                                                          f"send to the HTTP process ({exc}): ask "
                                                                          "for fewer logprobs")]))


def _load_error_message(exc: BaseException) -> str:
    from kvpilot.model.errors import ModelLoadError

    if isinstance(exc, (ModelLoadError, ValueError, OSError)):  # user errors: the message says what to do
        logger.error("loading the engine failed: %s", exc)
        return str(exc)
    logger.exception("loading the engine failed")
    return f"{type(exc).__name__}: {exc}"


def _say_ready(served: ServedEngine, core: EngineCore, endpoint: Endpoint) -> bool:
    try:
        endpoint.send(Ready(served.info, served.engine.tokenizer, core.stats))
        return True
    except (pickle.PicklingError, TypeError, AttributeError, MessageTooLargeError) as exc:  # e.g. a tokenizer
        # that does not pickle
        logger.exception("cannot send the engine's start-up facts to the server")
        endpoint.send(LoadFailed(f"the engine core cannot send its start-up facts ({exc}): run the server "
                                 "with --no-engine-process"))
        return False


def _start_kv_events(config: KVEventsConfig | None) -> ZmqKVEventPublisher | None:
    """The publisher the engine was configured with, or None; OSError when an endpoint cannot be bound (or
    connected to: a malformed address). Its first batch says AllBlocksCleared: this engine holds nothing yet."""
    if config is None or not config.publishes:
        return None
    from kvpilot.engine.kv_events import AllBlocksCleared
    from kvpilot.server.core.kv_event_publisher import ZmqKVEventPublisher

    publisher = ZmqKVEventPublisher(config)
    publisher.publish([AllBlocksCleared()])
    return publisher


def _start_kv_connector(served: ServedEngine) -> KVConnector | None:
    """The KV connector of a disaggregated worker (--kv-role), None otherwise; OSError when its port is taken."""
    if served.kv_transfer is None:
        return None
    from kvpilot.model import kv_transfer
    from kvpilot.server.core.kv_connector import KVConnector

    caches = served.engine.runner.kv_caches  # type: ignore[attr-defined]  # one rank (EngineArgs refuses TP)
    return KVConnector(served.engine, served.kv_transfer, kv_transfer.kv_layout(caches),
                       lambda ids: kv_transfer.read_blocks(caches, ids), share=kv_transfer.device_share_for(caches))


def run_core(build: Callable[[], ServedEngine], endpoint: Endpoint) -> None:
    """Builds the engine, sends Ready (or LoadFailed), serves until Shutdown or until the server side is
    gone, and closes the endpoint. Never raises for the server's absence: there is no one left to tell."""
    kv_events: ZmqKVEventPublisher | None = None
    connector: KVConnector | None = None
    try:
        try:
            served = build()
            kv_events = _start_kv_events(served.kv_events)
            connector = _start_kv_connector(served)
        except BaseException as exc:  # reported through /health and every request
            endpoint.send(LoadFailed(_load_error_message(exc)))
            return
        core = EngineCore(served.engine, endpoint, kv_events, connector)
        if not _say_ready(served, core, endpoint):
            return
        try:
            core.run()
        except GONE:
            logger.warning("the server closed the engine core's channel: the core exits")
        except BaseException as exc:
            logger.exception("the engine loop failed")
            with suppress(*GONE, OSError):
                endpoint.send(CoreFailed(f"{type(exc).__name__}: {exc}"))
    except GONE:
        logger.warning("the server went away while the engine core started: the core exits")
    finally:
        if kv_events is not None:
            kv_events.close()
        if connector is not None:
            connector.close()
        with suppress(OSError):
            endpoint.close()
