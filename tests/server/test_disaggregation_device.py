"""Disaggregation's same-host device transport (server/core/kv_connector.py's `share`; on GPUs model/kv_transfer.py's
CudaIpcShare): the pull offers it, the sender answers with its caches' descriptor instead of the bytes, the puller
copies the blocks and acknowledges, and only then are they freed.

Here the two workers' engine cores run as threads of this process, where CUDA IPC cannot open a handle of its own
process: the protocol runs over a share of the same shape that reaches the other engine's caches through a
registry (InProcessShare). With a GPU the servers run as processes over the real CUDA IPC handles
(test_cuda_ipc_between_two_gpu_servers, in benchmarks/gpu_checks.sh's tests stage)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from kvpilot.model import kv_transfer
from kvpilot.model.kv_offload import _gather
from tests.server.test_disaggregation import (_assert_idle_and_clean, _complete, _integrity, _metric, _prefill,
                                              _server)

_CACHES: dict[str, list[torch.Tensor]] = {}


class InProcessShare:
    """CudaIpcShare's interface over the caches of engines in this process (a registry instead of IPC handles)."""

    name = "in_process"
    fail = False  # set: pull() raises, as a handle the puller cannot open would

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self.key = f"cache-{id(kv_caches)}"
        _CACHES[self.key] = kv_caches
        self.pulls = 0

    def descriptor(self) -> dict[str, Any]:
        return {"key": self.key}

    def pull(self, engine_id: str, descriptor: dict[str, Any], block_ids: list[int]) -> torch.Tensor:
        if InProcessShare.fail:
            raise RuntimeError("cannot open the handle")
        self.pulls += 1
        return _gather(_CACHES[descriptor["key"]], block_ids).contiguous()


@pytest.fixture
def shared_workers(llm_fp32, monkeypatch):
    shares: list[InProcessShare] = []

    def share_for(caches):
        shares.append(InProcessShare(caches))
        return shares[-1]

    monkeypatch.setattr(kv_transfer, "device_share_for", share_for)
    with _server(llm_fp32, kv_role="prefill") as prefill, _server(llm_fp32, kv_role="decode") as decode:
        yield prefill, decode, shares


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 20000) for _ in range(n)] for n in (70, 33)]


def test_blocks_move_over_the_device_transport_and_match(shared_workers, prompts):
    prefill, decode, shares = shared_workers
    for prompt in prompts:
        reference = _complete(decode, prompt, 12).json()["choices"][0]["text"]
        params = _prefill(prefill, prompt)
        reply = _complete(decode, prompt, 12, params)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["text"] == reference
        assert body["kvpilot"]["kv_transfer_tokens"] == len(prompt) - 1
    assert sum(share.pulls for share in shares) == 2  # no bytes over the socket
    assert _metric(decode, 'kvpilot:kv_transfer_bytes_total{direction="pull"') == (5 + 3) * 737_280
    deadline = time.monotonic() + 5.0  # freed on the acknowledgement, with no other message to wake the loop
    while _integrity(prefill)["num_held_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_idle_and_clean(prefill, decode)


def test_a_copy_that_fails_is_recomputed_and_frees_both_sides(shared_workers, prompts, monkeypatch):
    prefill, decode, _ = shared_workers
    prompt = prompts[0]
    reference = _complete(decode, prompt, 8).json()["choices"][0]["text"]
    params = _prefill(prefill, prompt)
    monkeypatch.setattr(InProcessShare, "fail", True)
    reply = _complete(decode, prompt, 8, params)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == reference
    assert "kv_transfer_tokens" not in reply.json()["kvpilot"]
    assert _metric(decode, 'kvpilot:kv_transfer_failures_total{direction="pull"') == 1
    assert _metric(prefill, 'kvpilot:kv_transfer_failures_total{direction="send"') == 1
    _assert_idle_and_clean(prefill, decode)


def test_cuda_ipc_descriptor_round_trip_is_json():
    """CudaIpcShare's descriptor is plain JSON (no pickle crosses the wire); opening needs a GPU."""
    if not torch.cuda.is_available():
        assert kv_transfer.device_share_for([torch.zeros(2, 1, 4, 16, 8)]) is None  # a CPU cache: bytes
        pytest.skip("CUDA IPC needs a GPU (benchmarks/gpu_checks.sh runs this file there)")
    import json

    cache = torch.arange(2 * 3 * 4 * 16 * 8, dtype=torch.float32, device="cuda").view(2, 3, 4, 16, 8)
    share = kv_transfer.device_share_for([cache])
    assert share is not None and json.loads(json.dumps(share.descriptor())) == share.descriptor()


def test_cuda_ipc_between_two_gpu_servers(tmp_path):
    """Two `kvpilot serve` processes on one GPU (dummy Qwen3-0.6B, the same seed): the decode worker pulls over
    CUDA IPC and decodes what it decodes alone."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU (benchmarks/gpu_checks.sh runs this file there)")
    import sys

    import httpx

    from kvpilot.server.background import free_port
    from tests.served_process import serve_process

    def command(port: int, role: str) -> list[str]:
        return [sys.executable, "-m", "kvpilot.server", "--port", str(port), "--model", "qwen3-0.6b",
                "--load-format", "dummy", "--kv-cache-memory", "1GiB", "--max-model-len", "512", "--enforce-eager",
                "--kv-role", role, "--served-model-name", "m"]

    ports = [free_port("127.0.0.1") for _ in range(2)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    prompt = list(range(1000, 1070))
    body = {"model": "m", "prompt": prompt, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    with serve_process(command(ports[0], "prefill"), urls[0], tmp_path / "prefill.log"), \
            serve_process(command(ports[1], "decode"), urls[1], tmp_path / "decode.log"):
        reference = httpx.post(f"{urls[1]}/v1/completions", json={**body, "max_tokens": 12}, timeout=120).json()
        params = httpx.post(f"{urls[0]}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params":
                                                                {"do_remote_decode": True}}, timeout=120).json()
        reply = httpx.post(f"{urls[1]}/v1/completions", json={**body, "max_tokens": 12, "kv_transfer_params":
                                                               params["kv_transfer_params"]}, timeout=120).json()
    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    ours, theirs = (r["choices"][0]["logprobs"]["token_logprobs"] for r in (reply, reference))
    assert len(ours) == 12 and ours == pytest.approx(theirs, abs=1e-2)  # ids past the borrowed vocabulary too
    assert reply["kvpilot"]["kv_transfer_tokens"] == 69
    assert "over CUDA IPC" in (tmp_path / "decode.log").read_text()
