"""KvpilotReplica: one Ray Serve replica = one kvpilot engine behind kvpilot's own app (in process).

The ingress sends it ForwardedRequests (`forward`, a stream): the replica serves them with create_app's ASGI
app, so every route, error and header is exactly `kvpilot serve`'s. It posts its /metrics text and load to
the app's StatsHub about once a second. Invariants: the replica reports healthy only once its engine is
loaded and while it has not failed (Ray replaces a replica whose check_health raises); `forward` yields one
ResponseStart, then bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, AsyncIterator

from ray import serve

from kvpilot.server.ray_app.config import LaneConfig
from kvpilot.server.ray_app.forward import ForwardedRequest, ResponseStart, call_asgi
from kvpilot.server.ray_app.stats_hub import get_hub

logger = logging.getLogger("kvpilot.ray")
REPORT_INTERVAL_S = 1.0
LOAD_TIMEOUT_S = 600.0


def _limit_threads(cpus: float) -> None:
    """A replica's engine uses the CPUs Ray gave it, not every core (two replicas on one host would fight)."""
    threads = str(max(1, int(cpus)))
    os.environ["OMP_NUM_THREADS"] = threads  # read by torch in the engine core (a child: it inherits it)


class KvpilotReplica:
    async def __init__(self, lane: LaneConfig, served_model_names: tuple[str, ...], app_name: str) -> None:
        _limit_threads(lane.cpus_per_replica)
        from kvpilot.server.app import create_app
        from kvpilot.server.config import served_names
        from kvpilot.server.config import ServerArgs
        from kvpilot.server.core.engine_spec import engine_factory

        self.lane = lane
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine_args = _advertised(lane.engine_args())
        names = served_model_names or served_names(None, engine_args.model)
        # No api key or body limit here: the ingress checks them before a request reaches a replica.
        args = ServerArgs(served_model_names=names, engine_process=lane.engine_process,
                          max_num_queued_reqs=None, stats_interval=60.0)
        self.app = create_app(engine_factory(engine_args), args)
        self.state = self.app.state.kvpilot
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        try:
            await asyncio.to_thread(self._wait_loaded)
        except BaseException:  # a replica that failed to start stops its engine now (__del__ then skips it)
            await self._lifespan.__aexit__(None, None, None)
            raise
        self.hub = get_hub(app_name)
        self._reporter = asyncio.create_task(self._report_forever())
        logger.info("kvpilot replica %s (lane %s) ready", self.replica_id, lane.name)

    def _wait_loaded(self) -> None:
        client = self.state.client
        if not client.ready.wait(LOAD_TIMEOUT_S) or client.error is not None:
            raise RuntimeError(f"the engine of lane {self.lane.name!r} did not start: "
                               f"{client.error or f'not loaded after {LOAD_TIMEOUT_S:g} s'}")

    async def forward(self, fwd: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in call_asgi(self.app, fwd, self.replica_id):
            yield item

    async def check_health(self) -> None:
        if self.state.client.error is not None:
            raise RuntimeError(f"the engine failed: {self.state.client.error}")

    def load(self) -> dict[str, Any]:
        """What /v1/kvpilot/replicas shows of this replica (the engine's own counters)."""
        stats = self.state.client.stats
        if stats is None:
            return {}
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage, "prefix_cache_hits": stats.prefix_cache_hits,
                "prefix_cache_queries": stats.prefix_cache_queries, "num_preemptions": stats.num_preemptions}

    async def _report_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a hub restart must not stop the replica from serving
                await self.hub.report.remote(self.replica_id, self.lane.name, _text(self.state.metrics.render()),
                                             self.load())
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def __del__(self) -> None:
        # attributes set late in __init__ may be missing if it failed before them
        reporter = getattr(self, "_reporter", None)
        if reporter is None:
            return  # __init__ raised: it stopped the engine itself, or never started one
        reporter.cancel()
        with contextlib.suppress(Exception):
            await self.hub.goodbye.remote(self.replica_id)
        await self._lifespan.__aexit__(None, None, None)


def _advertised(engine_args: Any) -> Any:
    """A disaggregated worker advertises its node's address for KV pulls (not 127.0.0.1: the decode replica
    may run on another node), unless the lane names one."""
    if engine_args.kv_transfer() is None or engine_args.kv_transfer_host is not None:
        return engine_args
    import dataclasses

    import ray

    return dataclasses.replace(engine_args, kv_transfer_host=ray.util.get_node_ip_address())


def _text(rendered: bytes | str) -> str:
    return rendered.decode() if isinstance(rendered, bytes) else rendered
