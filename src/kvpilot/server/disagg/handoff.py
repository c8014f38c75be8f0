"""The prefill/decode hand-off of one request, as a router performs it (issue #49 item 2).

Disaggregated serving in vLLM's and SGLang's flow, over kvpilot's HTTP contract (docs/disaggregation.md):
  1. the router sends the client's request to a prefill worker (`kvpilot serve --kv-role prefill`) with
     `max_tokens: 1`, `stream: false` and `"kv_transfer_params": {"do_remote_decode": true}`; the worker
     prefills, keeps the prompt's KV blocks held for a decode worker, and answers with a top-level
     `kv_transfer_params` saying where to pull them from;
  2. the router sends the client's own request, plus those `kv_transfer_params`, to a decode worker
     (`--kv-role decode`), which pulls the blocks, computes what is left of the prompt and generates; its
     response (streamed or not) goes to the client as it is.
A prompt no longer than max_local_prefill_tokens skips step 1 (conditional disaggregation, as NVIDIA Dynamo
does): the decode worker prefills it itself, a chunk too small to stall its streams, and the prefill workers'
steps are left to the long prompts that would. This module is the pure part (bodies in, bodies out, which
worker next); the standalone proxy (proxy.py) and the Ray Serve ingress do the I/O. Invariant: the client's body is never modified in place.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass
from typing import Any

KV_TRANSFER_FIELD = "kv_transfer_params"
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Sampling fields that make no sense for the one throw-away prefill token (its answer is discarded).
_PREFILL_DROPPED = ("stream_options", "logprobs", "top_logprobs", "n", "best_of", "response_format",
                    "tools", "tool_choice", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar")


class HandoffError(Exception):
    """The hand-off cannot go on; `status` and the message are what the client gets (OpenAI error JSON)."""

    def __init__(self, status: int, message: str, code: str = "disaggregation_failed") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def parse_request(raw: bytes) -> dict[str, Any]:
    """The client's JSON body; HandoffError(400) if it is not a JSON object."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError as exc:
        raise HandoffError(400, f"the request body is not valid JSON: {exc}", "invalid_request_error") from exc
    if not isinstance(body, dict):
        raise HandoffError(400, "the request body must be a JSON object", "invalid_request_error")
    if KV_TRANSFER_FIELD in body:
        raise HandoffError(400, f"{KV_TRANSFER_FIELD} is set by the router: leave it out of requests sent to it",
                           "invalid_request_error")
    return body


# Prompts up to this many tokens are prefilled on their decode worker (0: every prompt goes to a prefill worker,
# as vLLM's proxy does): a short prefill costs the decode worker's streams less than the hop and the pull.
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 256
CHARS_PER_TOKEN = 4  # a text prompt's length in tokens, estimated without a tokenizer (English BPE: ~4)


def prompt_tokens_estimate(body: dict[str, Any]) -> int:
    """The prompt's length in tokens: exact for token-id prompts, else characters / CHARS_PER_TOKEN."""
    if "messages" in body:
        return _chars(body["messages"]) // CHARS_PER_TOKEN
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    return _chars(prompt) // CHARS_PER_TOKEN


def _chars(value: Any) -> int:
    """The characters of the text in a prompt or messages (content strings and text parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(item) for item in value)
    if isinstance(value, dict):
        return _chars(value.get("content")) + _chars(value.get("text"))
    return 0


def prefills_locally(body: dict[str, Any], max_local_prefill_tokens: int) -> bool:
    """Whether the decode worker prefills this prompt itself (0: never; see the module docstring)."""
    return max_local_prefill_tokens > 0 and prompt_tokens_estimate(body) <= max_local_prefill_tokens


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill worker gets: the client's prompt and model, one greedy token, no stream."""
    out = {k: copy.deepcopy(v) for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, temperature=0.0)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out[KV_TRANSFER_FIELD] = {"do_remote_decode": True}
    return out


def prefill_answer(status: int, payload: bytes) -> dict[str, Any]:
    """The kv_transfer_params of a prefill worker's answer (status and body); HandoffError carrying the worker's
    own status, message and error type when it failed, or 502 when a 200 lacks them."""
    try:
        answer = json.loads(payload)
    except ValueError:
        answer = None
    if status >= 400:
        error = answer.get("error") if isinstance(answer, dict) else None
        error = error if isinstance(error, dict) else {}
        message = error.get("message") or payload.decode("utf-8", "replace")[:500] or "the prefill worker failed"
        raise HandoffError(status, str(message), str(error.get("type") or "disaggregation_failed"))
    return transfer_params(answer)


def transfer_params(prefill_response: Any) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill worker's 200 answer; HandoffError(502) if they are missing."""
    params = prefill_response.get(KV_TRANSFER_FIELD) if isinstance(prefill_response, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise HandoffError(502, "the prefill worker answered without kv_transfer_params: start it with "
                                "`kvpilot serve --kv-role prefill` (or both)")
    return params


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """What the decode worker gets: the client's request as sent, plus where its prompt's KV waits."""
    return {**body, KV_TRANSFER_FIELD: params}


@dataclass
class WorkerPool:
    """Worker base URLs of one role; `pick` takes the one with the fewest requests in flight (round-robin
    among ties), `done` gives it back. Invariant: in_flight[url] >= 0 and counts picks not yet done."""

    urls: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a worker pool needs at least one URL")
        self.in_flight = {url: 0 for url in self.urls}
        self._order = itertools.cycle(range(len(self.urls)))

    def pick(self) -> str:
        start = next(self._order)
        rotated = self.urls[start:] + self.urls[:start]
        url = min(rotated, key=self.in_flight.__getitem__)
        self.in_flight[url] += 1
        return url

    def done(self, url: str) -> None:
        self.in_flight[url] -= 1
