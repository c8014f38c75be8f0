"""A test double of the Ray Serve app's contract in front of real kvpilot servers (Ray itself is not installed
here): generation requests go round-robin to the backends, each response carries ``x-kvpilot-replica``, and
``GET /metrics/replicas`` serves every backend's own ``/metrics`` with ``replica`` and ``lane`` labels added
to every sample (one HELP/TYPE per family). ``/metrics`` serves the same text (summed by readers)."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpilot.bench.client import REPLICA_HEADER

_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(\{(?P<labels>.*)\})?\s+(?P<rest>.+)$")


def labelled_exposition(replicas: list[tuple[str, str, str]]) -> str:
    """(replica id, lane, /metrics text) per replica -> one exposition, samples grouped by family."""
    families: dict[str, list[str]] = {}
    for rid, lane, text in replicas:
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                lines = families.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
            elif line.strip() and not line.startswith("#"):
                m = _SAMPLE.match(line)
                assert m is not None, line
                labels = (m["labels"] + ",") if m["labels"] else ""
                families.setdefault(family, []).append(
                    f'{m["name"]}{{{labels}replica="{rid}",lane="{lane}"}} {m["rest"]}')
    return "\n".join(line for lines in families.values() for line in lines) + "\n"


class ReplicaGateway:
    """Runs the double with uvicorn in a daemon thread on 127.0.0.1 and a free port (a context manager).
    Replica k is ``backends[k]``, id ``replica-k``, in ``lane``."""

    def __init__(self, backends: list[str], lane: str = "interactive") -> None:
        self.backends, self.lane = [b.rstrip("/") for b in backends], lane
        self.ids = [f"replica-{k}" for k in range(len(backends))]
        self._next = itertools.cycle(range(len(backends)))
        self._http: httpx.AsyncClient | None = None
        routes = [Route("/v1/completions", self._generate, methods=["POST"]),
                  Route("/v1/chat/completions", self._generate, methods=["POST"]),
                  Route("/v1/models", self._models), Route("/metrics", self._metrics),
                  Route("/metrics/replicas", self._metrics)]
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), log_level="critical", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:  # made on the server's own event loop
            self._http = httpx.AsyncClient(timeout=60.0)
        return self._http

    async def _generate(self, request: Request) -> Response:
        k = next(self._next)
        upstream = self.http.build_request("POST", self.backends[k] + request.url.path, content=await request.body(),
                                           headers={"content-type": "application/json"})
        resp = await self.http.send(upstream, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, headers={
            "content-type": resp.headers.get("content-type", "application/json"), REPLICA_HEADER: self.ids[k]})

    async def _models(self, request: Request) -> Response:
        resp = await self.http.get(self.backends[0] + "/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def _metrics(self, request: Request) -> Response:
        texts = [(await self.http.get(b + "/metrics")).text for b in self.backends]
        return PlainTextResponse(labelled_exposition([(rid, self.lane, t) for rid, t in zip(self.ids, texts)]))

    def __enter__(self) -> ReplicaGateway:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("replica gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
