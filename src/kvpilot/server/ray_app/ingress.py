"""KvpilotIngress: the Ray application's HTTP face. It checks the API key and body size, picks the lane,
computes the prompt's routing key, and streams the request to a replica of that lane (its router picks
which); it also serves /health, /metrics (aggregated), /metrics/replicas and /v1/kvpilot/replicas.

Invariants: a client sees exactly what a kvpilot replica answered (status, headers, body), plus
`x-kvpilot-replica` and `x-kvpilot-lane`; a replica that dies before answering costs the client nothing
(the request is retried once on another replica), one that dies mid-stream ends that stream with an
OpenAI error event; every failure the client can see is OpenAI-shaped JSON. With a prefill lane
(disaggregated serving, docs/disaggregation.md) a generate request is first prefilled on a replica of that
lane, then answered by a serving lane's decode replica, which pulls the prompt's KV (plus the header
`x-kvpilot-prefill-replica`).
"""

# No `from __future__ import annotations` here: Ray's ingress rewrites the route methods, and FastAPI must see
# `request: Request` as a type, not a string, to inject the request.
import dataclasses
import hmac
import json
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from kvpilot.server.disagg.handoff import (GENERATE_PATHS, HandoffError, decode_body, parse_request, prefill_body,
                                           prefill_answer, prefills_locally)
from kvpilot.server.openai.errors import APIError, install_error_handlers
from kvpilot.server.ray_app.config import RayAppConfig
from kvpilot.server.ray_app.forward import ForwardedRequest, ResponseStart, end_to_end
from kvpilot.server.ray_app.lanes import UnknownLaneError, choose_lane
from kvpilot.server.ray_app.metrics_merge import ReplicaMetrics, aggregate_text, per_replica_text
from kvpilot.server.ray_app.prefix_key import prompt_chars, prompt_text, route_key
from kvpilot.server.ray_app.replica_table import lanes_scaled_to_zero, replica_table
from kvpilot.server.ray_app.stats_hub import get_hub

logger = logging.getLogger("kvpilot.ray")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
_REPLICA_GONE = (RayActorError, ActorUnavailableError)
api = FastAPI(title="kvpilot (Ray Serve)")
install_error_handlers(api)  # APIError -> OpenAI JSON, as in kvpilot serve


# Helpers first: Ray pickles the ingress class when the module is still loading (the decorators run).
async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"the request body is larger than the application's max_request_body_bytes "
                              f"({max_bytes}): send a smaller request", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _rest(stream: Any, sse: bool, replica_id: str) -> AsyncIterator[bytes]:
    """The body after ResponseStart; a replica that dies mid-stream ends an SSE stream with an error event."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except Exception as exc:
        finished = True
        logger.warning("replica %s failed mid-response: %s", replica_id, exc)
        if sse:
            yield APIError(502, f"the replica serving this request ({replica_id}) failed mid-response: retry the "
                                "request", code="replica_failed").sse_data().encode()
    finally:
        if not finished:  # the client went away: stop the replica's work too (kvpilot aborts the request)
            stream.cancel()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress(api)
class KvpilotIngress:
    def __init__(self, config: RayAppConfig, lanes: dict[str, Any]) -> None:
        self.config, self.lanes = config, lanes
        self.prefill_lane, self.serving_lanes = config.prefill_lane, config.serving_lanes
        self.hub = get_hub(config.name)

    @api.get("/health")
    async def health(self) -> Response:
        """200 when one replica of every lane answers its own /health with 200 (a lane scaled to zero counts
        as ready without being woken); else 503 naming the lane."""
        asleep = lanes_scaled_to_zero(await self.hub.snapshot.remote(), self.config)
        for name in self.lanes:
            if name in asleep:
                continue
            try:
                start, _ = await self._call(name, ForwardedRequest("GET", "/health"))
            except APIError as exc:
                return APIError(503, f"lane {name!r}: {exc.message}", code="lane_unavailable").response()
            if start.status != 200:
                return APIError(503, f"lane {name!r} is not ready (its replica answered {start.status})",
                                code="lane_unavailable").response()
        return JSONResponse({"status": "ok", "lanes": list(self.lanes), "scaled_to_zero": asleep})

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._check_key(request)
        return Response(aggregate_text(await self._replica_metrics()), media_type=PROMETHEUS)

    @api.get("/metrics/replicas")
    async def metrics_replicas(self, request: Request) -> Response:
        self._check_key(request)
        return Response(per_replica_text(await self._replica_metrics()), media_type=PROMETHEUS)

    @api.get("/v1/kvpilot/replicas")
    async def replicas(self, request: Request) -> dict[str, Any]:
        self._check_key(request)
        return replica_table(await self.hub.snapshot.remote(), self.config)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, request: Request, path: str) -> Response:
        try:
            self._check_key(request)
            fwd, lane = await self._forwarded(request)
            prefilled_by = {}
            if self.prefill_lane is not None and fwd.method == "POST" and fwd.path in GENERATE_PATHS:
                fwd, prefilled_by = await self._prefilled(fwd)
            start, stream = await self._call(lane, fwd)
        except APIError as exc:
            return exc.response()
        # x-request-id: Ray's proxy sets it on every response (the id it passed in, which kvpilot kept).
        headers = {**{k: v for k, v in start.headers if k != "x-request-id"},
                   "x-kvpilot-replica": start.replica_id, "x-kvpilot-lane": lane, **prefilled_by}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(stream, sse, start.replica_id), status_code=start.status, headers=headers)

    def _check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` with the "
                                "application's api_key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _forwarded(self, request: Request) -> tuple[ForwardedRequest, str]:
        body = await _read_body(request, self.config.max_request_body_bytes)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica answers the 400 with kvpilot's own message
        prompt = prompt_text(parsed)
        try:
            lane = choose_lane(self.serving_lanes, request.headers, parsed, prompt_chars(prompt))
        except UnknownLaneError as exc:
            raise APIError(400, str(exc), param="X-Lane") from exc
        key = route_key(prompt) if self.config.routing == "prefix" else ()
        headers = tuple((k, v) for k, v in end_to_end(request.headers.items()) if k != "authorization")
        return ForwardedRequest(request.method, request.url.path, request.url.query.encode(), headers, body,
                                key), lane

    async def _prefilled(self, fwd: ForwardedRequest) -> tuple[ForwardedRequest, dict[str, str]]:
        """Disaggregated serving: prefills the request on the prefill lane (handoff.py) and returns it
        carrying the kv_transfer_params a decode replica pulls the KV with; a prefill replica's error is
        returned to the client as that replica gave it."""
        assert self.prefill_lane is not None
        try:
            body = parse_request(fwd.body)
        except HandoffError as exc:
            raise APIError(exc.status, exc.message, code=exc.code) from exc
        if prefills_locally(body, self.config.max_local_prefill_tokens):
            return fwd, {}  # short: its decode replica prefills it (handoff.py)
        start, stream = await self._call(self.prefill_lane, dataclasses.replace(
            fwd, body=json.dumps(prefill_body(body)).encode()))
        payload = b"".join([chunk async for chunk in stream])
        try:
            params = prefill_answer(start.status, payload)
        except HandoffError as exc:
            raise APIError(exc.status, exc.message, code=exc.code) from exc
        return (dataclasses.replace(fwd, body=json.dumps(decode_body(body, params)).encode()),
                {"x-kvpilot-prefill-replica": start.replica_id})

    async def _call(self, lane: str, fwd: ForwardedRequest) -> tuple[ResponseStart, Any]:
        """The replica's ResponseStart and the rest of its stream; a replica gone before answering: one retry."""
        for attempt in (0, 1):
            stream = self.lanes[lane].options(stream=True).forward.remote(fwd)
            try:
                return await stream.__anext__(), stream
            except _REPLICA_GONE as exc:
                logger.warning("lane %s: a replica died before answering (%s)%s", lane, type(exc).__name__,
                               "; retrying on another" if attempt == 0 else "")
                failure: Exception = exc
            except StopAsyncIteration:
                failure = RuntimeError("the replica ended the response before starting it")
            except Exception as exc:  # back-pressure, deployment gone: the lane cannot take it now
                raise APIError(503, f"lane {lane!r} cannot take the request now ({type(exc).__name__}: "
                                    f"{exc}); retry shortly", code="lane_unavailable",
                               headers={"Retry-After": "1"}) from exc
        raise APIError(503, f"lane {lane!r}: its replicas failed before answering ({failure}); retry shortly",
                       code="replica_failed", headers={"Retry-After": "1"})

    async def _replica_metrics(self) -> list[ReplicaMetrics]:
        return [ReplicaMetrics(r["replica_id"], r["lane"], r["metrics_text"]) for r in await self.hub.snapshot.remote()]
