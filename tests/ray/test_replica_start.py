"""A replica whose engine does not load in time fails to start and takes its engine core process down with it
(no cluster: the replica class is built directly; Serve's replica context is the only thing supplied)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from tests.ray.conftest import engine_settings

pytest.importorskip("ray")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# the garbage collector calls the async __del__ too, as Python does for any __del__, and cannot await it
@pytest.mark.filterwarnings("ignore:coroutine 'KvpilotReplica.__del__' was never awaited")
def test_a_replica_that_fails_to_start_stops_its_engine(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray import serve

    from kvpilot.server.ray_app import replica as replica_module
    from kvpilot.server.ray_app.config import parse_app_config

    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="replica-under-test"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(replica_module, "LOAD_TIMEOUT_S", 0.001)  # no engine loads this fast
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))  # the replica sets it
    (lane,) = parse_app_config(engine_settings(tiny_model)).lanes
    replica = object.__new__(replica_module.KvpilotReplica)

    async def start_then_delete() -> None:
        with pytest.raises(RuntimeError, match="did not start"):
            await replica.__init__(lane, ("tiny",), "app-under-test")
        await replica.__del__()  # Ray may still call it: nothing left to stop, no AttributeError

    asyncio.run(start_then_delete())
    pid = replica.state.client.core_pid
    assert pid is not None and not _alive(pid), "the engine core process outlived its failed replica"
