"""The engine's executor for tensor_parallel_size > 1: rank 0's runner in the engine process, the other ranks
in worker processes (kvpilot.model.parallel.worker), reached through a WorkerPool. A step's diff goes to every
worker, then rank 0 runs it; the layers' all-reduces keep the ranks in lockstep, and rank 0's handle is the
step's result.

A worker that fails reports its traceback; rank 0's next collective then fails after the group's timeout,
and the engine's step-failure handling takes over. Workers are daemons: they end with the engine process.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import socket
import time
from typing import Any

import torch

from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.parallel.worker import WorkerSpec, worker_main

START_TIMEOUT_S = 600.0


def free_tcp_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class WorkerPool:
    """Ranks 1..world_size-1 as spawned processes, one pipe each. Start-up waits name the rank that failed."""

    def __init__(self, spec: WorkerSpec) -> None:
        context = multiprocessing.get_context("spawn")
        self.connections: list[Any] = []
        self.processes: list[Any] = []
        for rank in range(1, spec.world_size):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(child, dataclasses.replace(spec, rank=rank)),
                                      daemon=True, name=f"kvpilot-tp-rank{rank}")
            process.start()
            self.connections.append(parent)
            self.processes.append(process)

    def wait_alive(self) -> None:
        """Blocks until every worker runs worker_main; ModelLoadError if one died first (typically a script
        without an `if __name__ == "__main__":` guard: spawned workers re-import the main module)."""
        for rank, (connection, process) in enumerate(zip(self.connections, self.processes), start=1):
            if _receive(connection, process, START_TIMEOUT_S) is not None:
                continue
            self.kill()
            raise ModelLoadError(
                f"tensor-parallel rank {rank} exited before starting (exit code {process.exitcode}): a script "
                "that builds a tensor-parallel engine must guard its entry point with "
                "`if __name__ == \"__main__\":` (worker processes re-import the main module)")

    def send_all(self, kind: str, payload: Any = None) -> None:
        for connection in self.connections:
            connection.send((kind, payload))

    def gather(self, kind: str, doing: str) -> list[Any]:
        """Every worker's next message, which must be `kind`; their payloads in rank order. ModelLoadError
        with the worker's traceback (or its exit) otherwise."""
        payloads = []
        for rank, (connection, process) in enumerate(zip(self.connections, self.processes), start=1):
            message = _receive(connection, process, START_TIMEOUT_S)
            if message is None:
                raise ModelLoadError(f"tensor-parallel rank {rank} exited or stayed silent for "
                                     f"{START_TIMEOUT_S:.0f} s while {doing} (exit code {process.exitcode})")
            got, payload = message
            if got != kind:
                raise ModelLoadError(f"tensor-parallel rank {rank} failed while {doing}:\n{payload}")
            payloads.append(payload)
        return payloads

    def stop(self) -> None:
        try:
            self.send_all("shutdown")
        except (OSError, ValueError):
            pass
        for process in self.processes:
            process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        self.connections, self.processes = [], []


class TensorParallelExecutor:
    """execute_model like a ModelRunner's; `runner` is rank 0's (its model and persistent batch). Shutdown puts
    back the process's torch thread count from before rank 0 took its share (num_threads_before)."""

    def __init__(self, runner: Any, workers: WorkerPool, group: Any, num_threads_before: int | None = None) -> None:
        self.runner = runner
        self._workers, self._group = workers, group
        self._num_threads_before = num_threads_before
        atexit.register(self.shutdown)

    def execute_model(self, output: SchedulerOutput):
        self._workers.send_all("step", output)
        return self.runner.execute_model(output)

    def shutdown(self) -> None:
        self._workers.stop()
        if self._group is not None:
            self._group.leave()  # the process-wide default group: the next tensor-parallel engine makes its own
            self._group = None
        if self._num_threads_before is not None:
            # a process that goes on without the ranks (an LLM user, a test session) gets its whole CPU back
            torch.set_num_threads(self._num_threads_before)
            self._num_threads_before = None


def _receive(connection, process, timeout_s: float) -> tuple[str, Any] | None:
    """The worker's next message; None when it exits (or closes its pipe) or stays silent past the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if connection.poll(0.1):
            try:
                return connection.recv()
            except EOFError:  # its end of the pipe closed: it is exiting
                process.join(5)
                return None
        if not process.is_alive():
            return None
    return None
