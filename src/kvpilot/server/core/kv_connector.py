"""The KV connector of disaggregated prefill/decode (engine/kv_transfer.py; wire format: docs/disaggregation.md).

Runs in the engine-core process, beside the step loop, on threads of its own: a prefill worker's sender accepts
pulls on its TCP port and streams held blocks out of the KV cache; a decode worker pulls a request's blocks into
bytes before the step loop adds the request. Only the step-loop thread touches the engine: the threads hand
their results over through queues that `tick` drains between steps (freeing held blocks, adding pulled requests).

Between GPU workers of one host the pull negotiates a device transport instead (`share`: model/kv_transfer.py's
CudaIpcShare): the sender answers with its caches' IPC handles, the puller copies the blocks device to device and
acknowledges, and only then are the blocks freed. Either side may lack it (a CPU worker, another host): bytes then.

Invariants: a held request is pulled at most once (a pull claims it); held blocks are freed exactly once, when
their pull ends (sent, failed or the decode side gone) or, unclaimed, when kv_transfer_timeout passes; a claimed
entry never times out, so the sender never reads a block that was freed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvpilot.engine.kv_transfer import KVTransferConfig, PulledKV, RemoteKVSource, tokens_digest

if TYPE_CHECKING:
    from kvpilot.engine.engine import LLMEngine
    from kvpilot.outputs import RequestOutput

logger = logging.getLogger("kvpilot.server")
PROTOCOL = "kvpilot-kv/1"
CONNECT_TIMEOUT_S = 5.0
RECV_POLL_S = 0.2  # a pull checks for cancellation this often
PULL_STALL_S = 30.0  # a pull that receives nothing this long gives up (the prefill worker hangs): recomputed
MAX_HEADER_BYTES = 1 << 20


class KVPullError(Exception):
    """A pull that failed in transport (refused connection, the prefill worker gone mid-transfer): the decode
    worker recomputes the prompt itself, as vLLM's connectors do by default."""


class KVPullRefused(KVPullError):
    """The prefill worker refused the pull (unknown or expired request, layout or prompt mismatch): the caller's
    kv_transfer_params are wrong, so the request fails with this message (a 400)."""


RECOMPUTE = None  # a pull's result when the decode worker computes the prompt itself


@dataclass
class _Held:
    block_ids: list[int]
    num_tokens: int
    digest: str
    deadline: float


@dataclass
class KVTransferStats:
    """Cumulative counters (exported as kvpilot:kv_transfer_* metrics)."""

    num_sent: int = 0
    num_sent_bytes: int = 0
    num_send_failures: int = 0
    num_timeouts: int = 0
    num_pulled: int = 0
    num_pulled_bytes: int = 0
    num_pull_failures: int = 0


@dataclass
class _Pull:
    message: Any  # the AddRequest
    cancelled: threading.Event = field(default_factory=threading.Event)


class KVConnector:
    """One engine core's sender (roles prefill/both) and puller (decode/both)."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig, layout: dict[str, Any],
                 read_blocks: Callable[[list[int]], memoryview], bind_host: str | None = None,
                 share: DeviceShare | None = None) -> None:
        """share: this worker's same-host device transport (None: blocks travel as bytes only)."""
        self.engine, self.config, self.layout, self._read, self.share = engine, config, layout, read_blocks, share
        self.engine_id = f"kvpilot-{uuid.uuid4().hex[:12]}"
        self.stats = KVTransferStats()
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._num_sending = 0  # claimed and not yet released: the step loop must keep ticking to free them
        self._released: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()  # (request id, sent)
        self._pulls: dict[str, _Pull] = {}
        self._pulled: queue.SimpleQueue[tuple[_Pull, PulledKV | str | None]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        if config.sends:
            self._listener = socket.create_server((bind_host or config.host, config.port))
            self.port = self._listener.getsockname()[1]
            threading.Thread(target=self._accept, name="kvpilot-kv-sender", daemon=True).start()
            engine.kv_transfer_address = {"remote_engine_id": self.engine_id, "remote_host": config.host,
                                          "remote_port": self.port}
            logger.info("KV sender of %s (--kv-role %s) on %s:%d", self.engine_id, config.role, config.host,
                        self.port)

    def stats_fields(self) -> dict[str, Any]:
        """The kv_transfer fields of SchedulerStats."""
        s = self.stats
        return dict(kv_transfer=True, num_kv_held_blocks=self.engine.scheduler.kv.num_held_blocks,
                    num_kv_transfers_sent=s.num_sent, num_kv_transfer_sent_bytes=s.num_sent_bytes,
                    num_kv_transfer_send_failures=s.num_send_failures, num_kv_transfers_pulled=s.num_pulled,
                    num_kv_transfer_pulled_bytes=s.num_pulled_bytes,
                    num_kv_transfer_pull_failures=s.num_pull_failures, num_kv_transfer_timeouts=s.num_timeouts)

    @property
    def busy(self) -> bool:
        """Pulls in flight, blocks held or being sent: the step loop must keep ticking with no request to step."""
        return bool(self._pulls or self._held or self._num_sending or not self._released.empty())

    # ---- the step loop's side ------------------------------------------------------------------------

    def register(self, outputs: list[RequestOutput]) -> None:
        """Finished prefill requests' held blocks, open for one pull until the timeout."""
        deadline = time.monotonic() + self.config.timeout_s
        for output in outputs:
            params = output.kv_transfer_params
            if params is None or not output.finished:
                continue
            num_tokens = params["num_remote_tokens"]
            with self._lock:
                self._held[output.request_id] = _Held(list(params["remote_block_ids"]), num_tokens,
                                                      tokens_digest(output.prompt_token_ids[:num_tokens]), deadline)

    def tick(self) -> list[tuple[Any, PulledKV | str | None]]:
        """Frees blocks whose pull ended or whose time ran out; returns the pulls that ended since the last tick
        as (AddRequest, result): the PulledKV; RECOMPUTE (None) after a transport failure; or a str, the error
        the request fails with ("" when it was cancelled, aborted meanwhile)."""
        while not self._released.empty():
            rid, _ = self._released.get()
            self.engine.release_held(rid)
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, h in self._held.items() if h.deadline <= now]  # a claimed one has left
            for rid in expired:
                del self._held[rid]
        for rid in expired:
            self.stats.num_timeouts += 1
            logger.warning("no decode worker pulled the KV of request %r in %.0f s: its blocks are freed", rid,
                           self.config.timeout_s)
            self.engine.release_held(rid)
        ended = []
        while not self._pulled.empty():
            pull, result = self._pulled.get()
            self._pulls.pop(pull.message.request_id, None)
            # aborted after its bytes came in, before this tick: dropped all the same
            ended.append((pull.message, "" if pull.cancelled.is_set() else result))
        return ended

    def start_pull(self, message: Any, source: RemoteKVSource) -> None:
        pull = _Pull(message)
        self._pulls[message.request_id] = pull
        threading.Thread(target=self._pull, args=(pull, source), name="kvpilot-kv-pull", daemon=True).start()

    def cancel(self, request_ids: list[str]) -> list[str]:
        """Cancels the pulls of these requests (they end as cancelled); returns the ids that had one."""
        found = [rid for rid in request_ids if rid in self._pulls]
        for rid in found:
            self._pulls[rid].cancelled.set()
        return found

    def close(self) -> None:
        self._closed.set()
        for pull in self._pulls.values():
            pull.cancelled.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the accept() blocked on it (close alone does not)
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    # ---- the sender's threads ------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvpilot-kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30.0)
            try:
                ask = json.loads(_read_line(conn))
            except (OSError, ValueError, KVPullError) as exc:
                logger.warning("a KV pull sent no valid request: %s", exc)
                return
            rid = str(ask.get("remote_request_id"))
            held, error = self._claim(ask, rid)
            if held is None:
                with contextlib.suppress(OSError):  # the decode side may be gone already
                    _send_line(conn, {"ok": False, "error": error})
                return
            try:
                if self._shares_with(ask):
                    self._send_shared(conn, held)
                else:
                    data = self._read(held.block_ids)
                    _send_line(conn, {"ok": True, "num_blocks": len(held.block_ids),
                                      "bytes_per_block": self.layout["bytes_per_block"]})
                    conn.sendall(data)
                self.stats.num_sent += 1
                self.stats.num_sent_bytes += len(held.block_ids) * self.layout["bytes_per_block"]
            except Exception as exc:  # noqa: BLE001 - the decode side gone, or reading the cache failed: the
                # decode worker recomputes; the blocks are freed either way
                self.stats.num_send_failures += 1
                logger.warning("sending the KV of request %r failed: %s", rid, exc)
            finally:
                self._release(rid)

    def _shares_with(self, ask: dict[str, Any]) -> bool:
        """Whether the puller takes this worker's device transport: it offered the same one, on the same host."""
        return self.share is not None and self.share.name in (ask.get("transports") or ()) and \
            ask.get("host_id") == host_id()

    def _send_shared(self, conn: socket.socket, held: _Held) -> None:
        """The device transport's reply (the caches' handles), then the puller's acknowledgement that it copied the
        blocks: until then they stay held (KVPullError when it does not come)."""
        assert self.share is not None
        _send_line(conn, {"ok": True, "transport": self.share.name, "num_blocks": len(held.block_ids),
                          "bytes_per_block": self.layout["bytes_per_block"], "share": self.share.descriptor()})
        ack = json.loads(_read_line(conn))
        if ack.get("done") is not True:
            raise KVPullError(f"the decode worker did not copy the blocks: {ack.get('error', ack)}")

    def _claim(self, ask: dict[str, Any], rid: str) -> tuple[_Held | None, str]:
        """The held entry the pull asks for, claimed (removed from the registry); or None and why not. A pull
        that names held blocks but fails a check frees them: the decode side gives the request up."""
        if ask.get("protocol") != PROTOCOL:
            return None, f"unknown protocol {ask.get('protocol')!r}: this worker speaks {PROTOCOL}"
        if ask.get("engine_id") != self.engine_id:
            return None, (f"remote_engine_id {ask.get('engine_id')!r} is not this worker ({self.engine_id}): it "
                          "restarted since the prefill, or the address is another worker's")
        with self._lock:
            held = self._held.pop(rid, None)
            self._num_sending += held is not None
        if held is None:
            return None, f"remote_request_id {rid!r} holds no KV here: unknown, already pulled or expired"
        mismatch = _mismatch(self.layout, ask.get("layout") or {})
        error = mismatch or ("" if ask.get("block_ids") == held.block_ids and ask.get("tokens_digest") == held.digest
                             else "remote_block_ids or the prompt differ from what the prefill worker holds")
        if error:
            self._release(rid)
            return None, error
        return held, ""

    def _release(self, rid: str) -> None:
        """Hands a claimed request's blocks back to the step loop to free (queued before the count drops, so
        `busy` never reads False in between)."""
        self._released.put((rid, True))
        with self._lock:
            self._num_sending -= 1

    # ---- the puller's threads ------------------------------------------------------------------------

    def _pull(self, pull: _Pull, source: RemoteKVSource) -> None:
        started = time.monotonic()
        result: PulledKV | str | None
        try:
            data = self._fetch(pull, source)
            result = PulledKV(source.num_tokens, len(source.block_ids), data, time.monotonic() - started)
            self.stats.num_pulled += 1
            self.stats.num_pulled_bytes += len(source.block_ids) * self.layout["bytes_per_block"]
        except (KVPullError, OSError, ValueError) as exc:  # ValueError: a reply that is not the protocol's JSON
            result = "" if pull.cancelled.is_set() else str(exc) if isinstance(exc, KVPullRefused) else RECOMPUTE
            if not pull.cancelled.is_set():
                self.stats.num_pull_failures += 1
                logger.warning("pulling the KV of request %r from %s:%d failed (%s)%s", pull.message.request_id,
                               source.host, source.port, exc, "" if result else ": it is recomputed here")
        self._pulled.put((pull, result))

    def _fetch(self, pull: _Pull, source: RemoteKVSource) -> Any:
        """The blocks' bytes (or, over the device transport, the share's tensor of them)."""
        prompt = pull.message.prompt_token_ids
        if len(prompt) < source.num_tokens:
            raise KVPullRefused(f"the prompt has {len(prompt)} tokens but the prefill worker held {source.num_tokens}: "
                              "send the same prompt to both workers")
        with socket.create_connection((source.host, source.port), timeout=CONNECT_TIMEOUT_S) as conn:
            transports = [self.share.name, "tcp"] if self.share is not None else ["tcp"]
            _send_line(conn, {"protocol": PROTOCOL, "engine_id": source.engine_id,
                              "remote_request_id": source.request_id, "block_ids": list(source.block_ids),
                              "tokens_digest": tokens_digest(prompt[:source.num_tokens]), "layout": self.layout,
                              "transports": transports, "host_id": host_id()})
            conn.settimeout(RECV_POLL_S)
            reply = json.loads(_read_line(conn, pull.cancelled))
            if not reply.get("ok"):
                raise KVPullRefused(f"the prefill worker refused the KV pull: {reply.get('error')}")
            if int(reply["bytes_per_block"]) != self.layout["bytes_per_block"]:
                raise KVPullRefused("the prefill worker's block size in bytes differs from this worker's")
            if self.share is not None and reply.get("transport") == self.share.name:
                return self._copy_shared(conn, source, reply)
            size = int(reply["num_blocks"]) * int(reply["bytes_per_block"])
            return _read_exact(conn, size, pull.cancelled)

    def _copy_shared(self, conn: socket.socket, source: RemoteKVSource, reply: dict[str, Any]) -> Any:
        """Copies the held blocks over the device transport, then acknowledges (the sender frees them on it)."""
        assert self.share is not None
        try:
            data = self.share.pull(source.engine_id, reply["share"], list(source.block_ids))
        except Exception as exc:  # noqa: BLE001 - a handle this process cannot open: recomputed here
            with contextlib.suppress(OSError):
                _send_line(conn, {"done": False, "error": str(exc)[:200]})
            raise KVPullError(f"the {self.share.name} copy failed: {exc}") from exc
        _send_line(conn, {"done": True})
        return data


class DeviceShare(Protocol):
    """A same-host device transport (model/kv_transfer.py's CudaIpcShare): the sender's descriptor() says how to
    reach its caches, the puller's pull() copies the named blocks into a tensor of the wire layout."""

    name: str

    def descriptor(self) -> dict[str, Any]: ...

    def pull(self, engine_id: str, descriptor: dict[str, Any], block_ids: list[int]) -> Any: ...


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This machine's identity for the device transport: the kernel's boot id (per boot, per machine) and the host
    name; two workers with the same one share a host (and its GPUs' IPC)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """'' when the KV layouts agree, else which field differs (block size, layers, heads, dtype...)."""
    for key, value in ours.items():
        if theirs.get(key) != value:
            return (f"KV layout mismatch: {key} is {value!r} on the prefill worker, {theirs.get(key)!r} on the "
                    "decode worker: run both with the same model, dtype, kv_cache_dtype and block_size")
    return ""


def _send_line(conn: socket.socket, obj: dict[str, Any]) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def _read_line(conn: socket.socket, cancelled: threading.Event | None = None) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = _recv(conn, 1, cancelled)
        data += chunk
        if len(data) > MAX_HEADER_BYTES:
            raise KVPullError("the KV transfer header is too long")
    return data.decode()


def _read_exact(conn: socket.socket, size: int, cancelled: threading.Event) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    last = time.monotonic()
    while got < size:
        try:
            n = conn.recv_into(view[got:], min(size - got, 1 << 20))
            last = time.monotonic()
        except socket.timeout:
            n = -1
            if time.monotonic() - last > PULL_STALL_S:
                raise KVPullError(f"the prefill worker sent nothing for {PULL_STALL_S:.0f} s") from None
        if cancelled.is_set():
            raise KVPullError("cancelled")
        if n == 0:
            raise KVPullError(f"the prefill worker closed the connection after {got} of {size} bytes: it stopped "
                              "or failed; resend the request")
        got += max(n, 0)
    return buffer


def _recv(conn: socket.socket, size: int, cancelled: threading.Event | None) -> bytes:
    """`size` bytes at most; the sender's side (no `cancelled`) raises on its socket's timeout, a pull polls for
    cancellation and gives up after PULL_STALL_S without a byte."""
    started = time.monotonic()
    while True:
        try:
            chunk = conn.recv(size)
        except socket.timeout:
            if cancelled is None or time.monotonic() - started > PULL_STALL_S:
                raise
            if cancelled.is_set():
                raise KVPullError("cancelled") from None
            continue
        if not chunk:
            raise KVPullError("the prefill worker closed the connection before answering: resend the request")
        return chunk
