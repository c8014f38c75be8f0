"""Prefill/decode disaggregation over HTTP (issue #49 item 2, docs/disaggregation.md): a prefill worker and a decode
worker on the real embedded model (float32, engine cores in threads sharing the session's weights) move a request's
KV over TCP; greedy output matches the decode worker's own (also under preemption), bad kv_transfer_params are
400s, and no block is left held or used on either side after pulls, failures, disconnects and timeouts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer, free_port
from tests.served_process import serve_process
from tests.server.conftest import API_KEY, authed_http, server_engine_args

MODEL = "disagg-test"
# fp32 KV of the embedded model: 737,280 bytes a block of 16 tokens; 6MiB is a pool of 8 blocks
TINY_POOL = dict(kv_cache_memory="6MiB", max_model_len=128, max_num_seqs=4)


def _server(llm_fp32, **engine) -> BackgroundServer:
    args = server_engine_args(enable_prefix_caching=False, **engine)
    app = create_app(engine_factory(args, loaded=llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=(MODEL,), api_key=API_KEY, engine_process=False))
    return BackgroundServer(app)


@pytest.fixture(scope="module")
def corpus_ids() -> list[int]:
    """Token ids to build prompts from (any ids of the vocabulary do for greedy comparisons)."""
    rng = random.Random(49)
    return [rng.randrange(100, 20000) for _ in range(400)]


@pytest.fixture(scope="module")
def workers(llm_fp32):
    """(prefill worker, decode worker with a pool of 8 blocks, a `both` worker with a 2 s hold timeout)."""
    with _server(llm_fp32, kv_role="prefill") as prefill, _server(llm_fp32, kv_role="decode", **TINY_POOL) as decode, \
            _server(llm_fp32, kv_role="both", kv_transfer_timeout=2.0) as both:
        yield prefill, decode, both


def _body(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def _prefill(server: BackgroundServer, prompt: list[int]) -> dict:
    with authed_http(server) as http:
        reply = http.post("/v1/completions", json=_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def _complete(server: BackgroundServer, prompt: list[int], max_tokens: int, params: dict | None = None) -> httpx.Response:
    extra = {"kv_transfer_params": params} if params is not None else {}
    with authed_http(server) as http:
        return http.post("/v1/completions", json=_body(prompt, max_tokens, **extra))


def _integrity(server: BackgroundServer) -> dict:
    with authed_http(server) as http:
        return http.get("/v1/kvpilot/integrity").json()


def _assert_idle_and_clean(*servers: BackgroundServer, timeout_s: float = 10.0) -> None:
    """Each server's invariants hold and, within timeout_s, no block is used or held."""
    for server in servers:
        deadline = time.monotonic() + timeout_s
        state = _integrity(server)
        while (state["num_used_blocks"] or state["num_held_blocks"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            state = _integrity(server)
        assert state["ok"] and state["num_used_blocks"] == 0 and state["num_held_blocks"] == 0, state


def test_decode_on_another_worker_gives_the_same_greedy_output(workers, corpus_ids):
    prefill, decode, _ = workers
    prompt = corpus_ids[:70]  # 5 blocks of 16, the last one partial
    reference = _complete(decode, prompt, 12).json()
    params = _prefill(prefill, prompt)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["num_remote_tokens"] == 70 and len(params["remote_block_ids"]) == 5
    assert _integrity(prefill)["num_held_blocks"] == 5  # held until pulled
    reply = _complete(decode, prompt, 12, params)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["text"] == reference["choices"][0]["text"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 69  # all but the last prompt token
    assert body["kvpilot"]["kv_transfer_tokens"] == 69 and body["kvpilot"]["kv_transfer_ms"] > 0
    # the prefill worker frees the blocks once sent, with no other message to wake its loop (/metrics sends none)
    deadline = time.monotonic() + 5.0
    while _metric(prefill, "kvpilot:kv_transfer_held_blocks") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(prefill, "kvpilot:kv_transfer_held_blocks") == 0
    assert _metric(prefill, 'kvpilot:kv_transfers_total{direction="send"') == 1
    assert _metric(decode, 'kvpilot:kv_transfer_bytes_total{direction="pull"') == 5 * 737_280
    _assert_idle_and_clean(prefill, decode)
    # pulled once: a second pull of the same request names it unknown, as a 400, and frees nothing twice
    again = _complete(decode, prompt, 4, params)
    assert again.status_code == 400 and "remote_request_id" in again.json()["error"]["message"]


def test_the_decode_worker_under_preemption_matches_too(workers, corpus_ids):
    prefill, decode, _ = workers
    prompts = [corpus_ids[100 * i:100 * i + 50] for i in range(3)]  # 4 blocks each, 6 with 32 tokens: 18 > 8
    references = [_complete(decode, p, 32).json()["choices"][0]["text"] for p in prompts]
    params = [_prefill(prefill, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda pair: _complete(decode, pair[0], 32, pair[1]), zip(prompts, params)))
    bodies = [r.json() for r in replies]
    assert [b["choices"][0]["text"] for b in bodies] == references
    assert sum(b["kvpilot"]["num_preemptions"] for b in bodies) > 0
    _assert_idle_and_clean(prefill, decode)


def test_bad_kv_transfer_params_are_400s(workers, corpus_ids):
    prefill, decode, both = workers
    prompt = corpus_ids[:40]
    with authed_http(both) as http:  # a prefill request may stream: its last chunk carries the params
        events = http.post("/v1/completions", json=_body(prompt, 1, stream=True,
                                                         kv_transfer_params={"do_remote_decode": True})).text
    good = json.loads([e for e in events.split("\n\n") if "kv_transfer_params" in e][0].removeprefix("data: "))[
        "kv_transfer_params"]
    cases = [
        (decode, {"do_remote_decode": "yes"}, "boolean"),
        (decode, {**good, "remote_port": "x"}, "remote_port"),
        (decode, {**good, "remote_block_ids": []}, "remote_block_ids"),
        (decode, {"do_remote_decode": True}, "--kv-role prefill or both"),  # a decode worker does not prefill
        (prefill, good, "--kv-role decode or both"),
        (decode, {**good, "remote_request_id": "nobody"}, "holds no KV here"),
        (decode, {**good, "remote_engine_id": "kvpilot-gone"}, "is not this worker"),
    ]
    for server, params, message in cases:
        reply = _complete(server, prompt, 4, params)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], (params, reply.text)
    # the held request is untouched by the refused pulls: a `both` worker serves it to itself
    reply = _complete(both, prompt, 4, good)
    assert reply.status_code == 200 and reply.json()["kvpilot"]["kv_transfer_tokens"] == 39, reply.text
    _assert_idle_and_clean(prefill, decode, both)


def test_held_blocks_are_freed_when_no_decode_worker_comes(workers, corpus_ids):
    *_, both = workers
    params = _prefill(both, corpus_ids[:50])
    assert _integrity(both)["num_held_blocks"] == 4
    _assert_idle_and_clean(both, timeout_s=6.0)  # the 2 s timeout frees them
    assert _complete(both, corpus_ids[:50], 4, params).status_code == 400  # expired


def test_a_disconnect_storm_on_the_decode_side_leaks_nothing(workers, corpus_ids):
    prefill, decode, _ = workers
    prompts = [corpus_ids[50 * i:50 * i + 60] for i in range(6)]
    params = [_prefill(prefill, p) for p in prompts]

    def cancelled(pair, after_s: float) -> None:
        try:
            with authed_http(decode) as http:
                with http.stream("POST", "/v1/completions",
                                 json=_body(pair[0], 60, stream=True, kv_transfer_params=pair[1])) as reply:
                    deadline = time.monotonic() + after_s
                    for _ in reply.iter_lines():
                        if time.monotonic() > deadline:
                            break
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=cancelled, args=(pair, 0.05 * i)) for i, pair in enumerate(zip(prompts, params))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    _assert_idle_and_clean(prefill, decode)


class _Relay:
    """A TCP relay between a decode worker and a prefill worker's KV sender, standing in for the network: it can
    hold the reply back `delay_s` (a slow link: pulls cancelled mid-pull) or cut both connections after
    `cut_after` reply bytes (the prefill worker gone mid-transfer)."""

    def __init__(self, upstream_port: int, cut_after: int | None = None, delay_s: float = 0.0,
                 hold_s: float = 0.0) -> None:
        """hold_s: after cut_after bytes, keep both connections open this long (set `cut` first) before
        cutting them."""
        self.upstream_port, self.cut_after, self.delay_s, self.hold_s = upstream_port, cut_after, delay_s, hold_s
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.cut_after, self.delay_s),
                             daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, cut_after: int | None, delay_s: float) -> None:
        time.sleep(delay_s)
        sent = 0
        try:
            while cut_after is None or sent < cut_after:
                data = source.recv(min(1 << 16, cut_after - sent) if cut_after is not None else 1 << 16)
                if not data:
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        if cut_after is not None and sent >= cut_after:
            self.cut.set()
            time.sleep(self.hold_s)
        for sock in (source, sink):  # either side gone, or the cut: both connections end
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()


def _metric(server: BackgroundServer, line_start: str) -> float:
    with authed_http(server) as http:
        text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_a_transfer_cut_midway_is_recomputed_and_frees_both_sides(workers, corpus_ids):
    prefill, decode, _ = workers
    prompt = corpus_ids[200:270]
    reference = _complete(decode, prompt, 8).json()["choices"][0]["text"]
    params = _prefill(prefill, prompt)
    failures = _metric(decode, 'kvpilot:kv_transfer_failures_total{direction="pull"')
    relay = _Relay(params["remote_port"], cut_after=1_000_000)  # of 5 blocks, 3.7 MB
    try:
        reply = _complete(decode, prompt, 8, {**params, "remote_port": relay.port})
    finally:
        relay.close()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["text"] == reference and "kv_transfer_tokens" not in body["kvpilot"]
    assert _metric(decode, 'kvpilot:kv_transfer_failures_total{direction="pull"') == failures + 1
    # nothing listens there (a prefill worker that is gone): recomputed as well
    reply = _complete(decode, prompt, 8, {**params, "remote_port": free_port("127.0.0.1")})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == reference
    _assert_idle_and_clean(prefill, decode)
    assert _metric(prefill, "kvpilot:kv_transfer_held_blocks") == 0


def test_a_decode_worker_gone_mid_pull_frees_the_prefill_side(workers, corpus_ids):
    """Requests cancelled by their clients while their pull waits on a slow link: the decode worker drops the
    pulls (nothing allocated), the prefill worker frees the blocks when the connection ends."""
    prefill, decode, _ = workers
    prompts = [corpus_ids[30 * i:30 * i + 64] for i in range(4)]
    params = [_prefill(prefill, p) for p in prompts]
    assert _integrity(prefill)["num_held_blocks"] == 4 * 4
    relay = _Relay(params[0]["remote_port"], delay_s=1.5)

    def cancelled(pair) -> None:
        try:
            with authed_http(decode) as http:
                http.post("/v1/completions", json=_body(pair[0], 8, kv_transfer_params={**pair[1], "remote_port":
                                                                                          relay.port}), timeout=0.3)
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=cancelled, args=(pair,)) for pair in zip(prompts, params)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    _assert_idle_and_clean(prefill, decode)
    relay.close()
    # the decode worker serves on
    assert _complete(decode, prompts[0], 4).status_code == 200


def test_serve_maps_vllm_kv_transfer_config_and_refuses_what_it_lacks(monkeypatch) -> None:
    from typer.testing import CliRunner

    from kvpilot.cli import app
    from kvpilot.server import cli as serve_cli

    for flags, message in ((["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
                            "KvpilotConnector or TcpConnector"),
                           (["--kv-transfer-config", '{"kv_connector": "TcpConnector", "kv_role": "kv_sender"}'],
                            "kv_producer, kv_consumer, kv_both"),
                           (["--kv-role", "router"], "prefill, decode, both"),
                           (["--kv-role", "decode", "--tensor-parallel-size", "2"], "not supported yet")):
        result = CliRunner().invoke(app, ["serve", *flags])
        assert result.exit_code == 2 and message in result.output, (flags, result.output)
    seen = {}
    monkeypatch.setattr(serve_cli, "_serve", lambda engine_args, *rest: seen.setdefault("args", engine_args) and 0)
    CliRunner().invoke(app, ["serve", "--host", "10.0.0.5", "--kv-transfer-config",
                             '{"kv_connector": "KvpilotConnector", "kv_role": "kv_producer", "kv_port": 14579}'])
    config = seen["args"].kv_transfer()
    assert (config.role, config.host, config.port) == ("prefill", "10.0.0.5", 14579)


def test_killing_the_prefill_worker_mid_transfer(workers, corpus_ids, tmp_path):
    """A real `kvpilot serve --kv-role prefill` process killed (SIGKILL) while a pull has received part of the
    blocks (a relay holds the rest back meanwhile): the decode worker recomputes, same output, nothing leaked."""
    _, decode, _ = workers
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", str(port), "--dtype", "float32",
               "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--kv-role", "prefill", "--api-key", API_KEY,
               "--served-model-name", MODEL]
    url = f"http://127.0.0.1:{port}"
    # its start took 5-7 s alone (also beside `yes` x3), 79-276 s in busy suite runs (serve_process waits 300 s)
    with serve_process(command, url, tmp_path / "prefill.log") as worker:
        prefill = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        prompt = corpus_ids[:70]
        reference = _complete(decode, prompt, 8).json()["choices"][0]["text"]
        params = prefill.post("/v1/completions", json=_body(prompt, 1, kv_transfer_params={"do_remote_decode": True})
                              ).json()["kv_transfer_params"]
        relay = _Relay(params["remote_port"], cut_after=1_000_000, delay_s=0.0, hold_s=1.0)
        result: list[httpx.Response] = []
        pulling = threading.Thread(target=lambda: result.append(
            _complete(decode, prompt, 8, {**params, "remote_port": relay.port})))
        pulling.start()
        relay.cut.wait(30)  # the decode worker has part of the blocks; the relay holds the rest
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(30)
        pulling.join(60)
        relay.close()
    assert result and result[0].status_code == 200, result
    assert result[0].json()["choices"][0]["text"] == reference
    assert "kv_transfer_tokens" not in result[0].json()["kvpilot"]
    _assert_idle_and_clean(decode)
