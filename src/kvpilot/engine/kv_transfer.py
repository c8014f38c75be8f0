"""Prefill/decode disaggregation's engine-side contract (issue #49, docs/disaggregation.md), torch-free.

A prefill worker serves a request with `do_remote_decode`: it computes the prompt and one token, then keeps the
request's blocks held (the KV manager keeps its table, so its ref counts keep them from eviction and reuse) until a
decode worker pulls them or a timeout passes. A decode worker serves a request with `do_remote_prefill`: the
engine core pulls the blocks' K/V (server/core/kv_connector.py) before it adds the request, attached as a PulledKV;
at admission the KV manager allocates pool blocks for them and orders the bytes copied in (SchedulerOutput.kv_loads,
executed by the runner before the forward), and the request starts with those tokens computed.

This module parses the request field (vLLM's names), and holds the typed records both sides pass around.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

KV_ROLES = ("prefill", "decode", "both")
# vLLM's kv_transfer_config roles, mapped onto ours
VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
KV_CONNECTORS = ("KvpilotConnector", "TcpConnector")  # the one connector kvpilot has, under two names


class KVTransferParamsError(ValueError):
    """A request's kv_transfer_params are malformed or not allowed on this worker; the message names the field."""


@dataclass(frozen=True)
class RemoteKVSource:
    """Where a decode request's KV lies: the prefill worker's engine, the request id it holds the blocks under,
    its KV sender's address, the held blocks and the prompt tokens whose K/V they hold."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class KVTransferRequest:
    """What a request asks of disaggregation: hold its KV for a decode worker (`do_remote_decode`, a prefill
    request), or pull it from `source` (a decode request). Never both."""

    do_remote_decode: bool = False
    source: RemoteKVSource | None = None


@dataclass(frozen=True)
class PulledKV:
    """K/V pulled for a decode request: num_blocks blocks in the wire layout (docs/disaggregation.md) holding the
    first num_tokens prompt tokens, and how long the pull took. `data`: the bytes, or from a same-host device
    transport (CUDA IPC) a device tensor of that layout (torch-free here: the runner writes either)."""

    num_tokens: int
    num_blocks: int
    data: Any
    transfer_s: float


@dataclass(frozen=True)
class KVLoad:
    """A copy order of one step: `data` (num blocks in the wire layout: PulledKV.data) into pool blocks `block_ids`."""

    block_ids: tuple[int, ...]
    data: Any


def tokens_digest(token_ids: list[int]) -> str:
    """A digest of the prompt tokens whose K/V is transferred: both sides must hold the same prompt."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _field(params: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise KVTransferParamsError(f"kv_transfer_params.{name} must be a {expected}, got {value!r}: send the "
                                    "kv_transfer_params of the prefill worker's response unchanged")
    return value


def parse_kv_transfer_params(params: Any) -> KVTransferRequest | None:
    """The request's kv_transfer_params (None or {}: a plain request); KVTransferParamsError names what is wrong."""
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        raise KVTransferParamsError("kv_transfer_params.do_remote_decode and .do_remote_prefill must be booleans")
    if decode and prefill:
        raise KVTransferParamsError("kv_transfer_params asks for both do_remote_decode and do_remote_prefill: "
                                    "a request is either a prefill request or a decode request")
    if not prefill:
        return KVTransferRequest(do_remote_decode=decode) if decode else None
    block_ids = _field(params, "remote_block_ids", list)
    if not block_ids or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a non-empty list of block ids")
    port = _field(params, "remote_port", int)
    num_tokens = _field(params, "num_remote_tokens", int)
    if not 0 < port < 65536 or num_tokens < 1:
        raise KVTransferParamsError("kv_transfer_params.remote_port must be a TCP port and num_remote_tokens "
                                    "positive")
    source = RemoteKVSource(str(_field(params, "remote_engine_id", str)), _field(params, "remote_request_id", str),
                            _field(params, "remote_host", str), port, tuple(block_ids), num_tokens)
    return KVTransferRequest(source=source)


def check_role(request: KVTransferRequest, role: str | None) -> None:
    """KVTransferParamsError when this worker's --kv-role does not serve the request's kind."""
    if request.do_remote_decode and role not in ("prefill", "both"):
        raise KVTransferParamsError(f"kv_transfer_params.do_remote_decode needs a worker started with --kv-role "
                                    f"prefill or both; this one has {_role_name(role)}: send it to a prefill worker")
    if request.source is not None and role not in ("decode", "both"):
        raise KVTransferParamsError(f"kv_transfer_params.do_remote_prefill needs a worker started with --kv-role "
                                    f"decode or both; this one has {_role_name(role)}: send it to a decode worker")


def _role_name(role: str | None) -> str:
    return f"--kv-role {role}" if role else "disaggregation off"


@dataclass(frozen=True)
class KVTransferConfig:
    """A worker's disaggregation settings (--kv-role, --kv-transfer-host/-port/-timeout): its role, the address
    its KV sender advertises (port 0: a free one, picked at start) and how long held blocks wait for a pull."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise KVTransferParamsError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if not 0 <= self.port < 65536 or self.timeout_s <= 0:
            raise KVTransferParamsError("kv_transfer_port must be a TCP port (0: any free one) and "
                                        "kv_transfer_timeout positive")

    @property
    def sends(self) -> bool:
        return self.role in ("prefill", "both")


def role_of_vllm_config(config: dict[str, Any]) -> tuple[str, str | None, int | None]:
    """(role, kv_ip, kv_port) of vLLM's --kv-transfer-config; KVTransferParamsError names what is accepted."""
    connector = config.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise KVTransferParamsError(f"kv_transfer_config.kv_connector {connector!r} is not supported: kvpilot "
                                    "has one connector (TCP; CUDA IPC between GPUs of one host), named "
                                    f"{' or '.join(KV_CONNECTORS)}")
    role = config.get("kv_role")
    if role not in VLLM_KV_ROLES:
        raise KVTransferParamsError(f"kv_transfer_config.kv_role must be one of {', '.join(VLLM_KV_ROLES)}, got "
                                    f"{role!r}")
    port = config.get("kv_port")
    return VLLM_KV_ROLES[role], config.get("kv_ip"), int(port) if port is not None else None
