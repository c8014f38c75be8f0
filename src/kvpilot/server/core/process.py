"""Where the engine core runs: a spawned child process (the default) or a thread of the server process.

The process is started with the "spawn" method: forking a process that already runs torch or uvicorn
threads can deadlock the child. The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process
group; the server drains first, then stops the core), and exits on its own when the server process is gone:
its pipe reads EOF while serving, and a watchdog notices the re-parenting while the model still loads.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from kvpilot.server.core.channel import Endpoint, queue_endpoint_pair
from kvpilot.server.core.step_loop import run_core
from kvpilot.server.core.engine_spec import EngineFactory, EngineSpec
from kvpilot.server.gc_heap import freeze_startup_heap
from kvpilot.server.observe.log_writer import detach_output, stacks_on_sigusr1
from kvpilot.server.core.pipe_channel import ChannelWatchdog, PipeEndpoint

logger = logging.getLogger("kvpilot.server")
DEFAULT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ORPHAN_CHECK_S = 0.5


@dataclass(frozen=True)
class LogSetup:
    """The server's root logging (level, format), repeated in the child: a spawned process starts bare."""

    level: int
    format: str | None

    @staticmethod
    def of_this_process() -> LogSetup:
        root = logging.getLogger()
        formats = [getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter is not None]
        return LogSetup(root.level, (formats[0] or DEFAULT_LOG_FORMAT) if formats else None)

    def apply(self) -> None:
        if self.format is not None:
            logging.basicConfig(level=self.level, format=self.format)
        else:
            logging.getLogger().setLevel(self.level)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)  # noqa: SLF001 - no one is left to serve; skip cleanup that could block on the dead pipe


def _frozen_once_built(spec: EngineSpec) -> Callable[[], Any]:
    """The spec's build, then the start-up heap frozen (gc_heap.py): this process lives as long as the server."""
    def build() -> Any:
        served = spec()
        freeze_startup_heap()
        return served
    return build


def core_main(spec: EngineSpec, inbox: Connection, outbox: Connection, log: LogSetup, parent_pid: int) -> None:
    """The core process's entry point (module level: spawn imports it by name)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.apply()
    output = detach_output()  # a log write waits on a thread of its own, never in the step loop
    stacks_on_sigusr1()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="kvpilot-orphan-watch",
                     daemon=True).start()
    endpoint = PipeEndpoint(inbox, outbox, "to the HTTP process")
    ChannelWatchdog(endpoint)
    run_core(_frozen_once_built(spec), endpoint)
    # The core's work ends here (its channel is closed); a full interpreter teardown with torch loaded takes
    # seconds that the server's shutdown would wait for.
    logging.shutdown()
    output.drain()
    os._exit(0)  # noqa: SLF001


class CoreProcess:
    """The engine core in a child process. `endpoint` is the server's side of the channel."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        to_core_r, to_core_w = ctx.Pipe(duplex=False)
        from_core_r, from_core_w = ctx.Pipe(duplex=False)
        # a daemon may not start processes: a tensor-parallel core starts its ranks (it still exits with the
        # server: core_main watches the server's pid)
        daemon = spec.args.tensor_parallel_size == 1
        self._process = ctx.Process(target=core_main, name="kvpilot-engine-core", daemon=daemon,
                                    args=(spec, to_core_r, from_core_w, LogSetup.of_this_process(), os.getpid()))
        self._process.start()
        # The child holds its own copies now; without ours, EOF on either side means the other is gone.
        to_core_r.close()
        from_core_w.close()
        self.endpoint: Endpoint = PipeEndpoint(from_core_r, to_core_w, "to the engine core")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def join(self, timeout_s: float) -> bool:
        """True once the process has exited (and is reaped)."""
        self._process.join(timeout_s)
        return self._process.exitcode is not None

    def kill(self) -> None:
        self._process.kill()
        self._process.join(5)

    def describe_exit(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "the engine core process stopped answering"
        if code < 0:
            return f"the engine core process was killed by {signal.Signals(-code).name}"
        return f"the engine core process exited with code {code}"


class CoreThread:
    """The engine core in a daemon thread of the server process (`--no-engine-process`, tests that share
    weights already loaded in this process)."""

    pid: int | None = None

    def __init__(self, factory: EngineFactory) -> None:
        self.endpoint, core_side = queue_endpoint_pair()
        self._thread = threading.Thread(target=run_core, args=(factory, core_side), name="kvpilot-engine",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def kill(self) -> None:
        logger.warning("the engine thread did not stop in time; it ends with the process")

    def describe_exit(self) -> str:
        return "the engine thread ended"


Core = CoreProcess | CoreThread


def start_core(factory: EngineFactory | Any, in_process: bool) -> Core:
    """Starts the core (thread when `in_process`); the caller checked that a process gets an EngineSpec."""
    return CoreThread(factory) if in_process else CoreProcess(factory)
