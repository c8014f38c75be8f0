"""LLM: the offline API (vLLM-shaped), driving the same engine loop as the server."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from kvpilot.launch.args import EngineArgs
from kvpilot.launch.build import build_engine
from kvpilot.model.loader import LoadedModel
from kvpilot.outputs import RequestOutput
from kvpilot.sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict[str, Any]  # dict: vLLM's TextPrompt {"prompt"} / TokensPrompt {"prompt_token_ids"}
Messages = list[dict[str, Any]]
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """`LLM(model=None)` loads the embedded SmolLM2-135M-Instruct; keyword arguments are EngineArgs fields
    (max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, gpu_memory_utilization, block_size,
    enable_prefix_caching, scheduling_policy, dtype, load_format, device, seed, attention_backend,
    async_scheduling, speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4},
    kv_offloading_size: KV offload's host tier, GiB or "512MiB", kv_offload_dir / kv_offload_dir_size: its disk
    tier; docs/server.md, "KV offload")."""

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_kwargs: Any) -> None:
        """`loaded` reuses the weights of another LLM (`other.loaded`) with different engine settings."""
        unknown = set(engine_kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            allowed = ", ".join(sorted(EngineArgs.__dataclass_fields__))
            raise TypeError(f"LLM() got unknown settings {sorted(unknown)}; allowed: {allowed}")
        if engine_kwargs.get("kv_events_config") is not None:  # nothing would drain the events offline
            raise TypeError("LLM() does not publish KV-cache events: pass kv_events_config to `kvpilot serve` "
                            "(--kv-events-config), whose engine core publishes them")
        if any(engine_kwargs.get(k) is not None for k in ("kv_role", "kv_transfer_config")):  # no connector here
            raise TypeError("LLM() does not serve or pull KV transfers: pass kv_role / kv_transfer_config to "
                            "`kvpilot serve` (--kv-role), whose engine core runs the KV connector")
        built = build_engine(EngineArgs(model=model, **engine_kwargs), loaded)
        self.engine, self.loaded = built.engine, built.loaded
        self.tokenizer = self.loaded.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Runs all prompts together (continuous batching); returns their final outputs in prompt order.

        A prompt is a string, a list of token ids, or as vLLM's {"prompt": str} / {"prompt_token_ids": [ids]};
        a single prompt may be passed without a list.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        ids: list[str] = []
        try:
            for prompt, sp, pr in zip(prompt_list, params, priorities):
                ids.append(self.engine.add_request(prompt, sp, priority=pr))
        except Exception:  # a refused request refuses the batch: leave none of it queued
            self.engine.abort_request(ids)
            for _ in self._drain():
                pass
            raise
        finals = {o.request_id: o for o in self._drain() if o.finished}
        return [finals[i] for i in ids]

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template: use generate() with token ids")
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields this request's outputs step by step (text deltas in `delta_text`) until it finishes. Closing
        the iterator early (`break`, `.close()`, an exception in the consumer) aborts the request: it stops
        running and its KV blocks are freed before close() returns."""
        request_id = self.engine.add_request(_plain_prompt(prompt), sampling_params or SamplingParams())
        finished = False
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
                        if finished:
                            return
        finally:
            if not finished:
                self.engine.abort_request(request_id)
                while self.engine.has_unfinished_requests() and not any(
                        o.request_id == request_id and o.finished for o in self.engine.step()):
                    pass

    def _drain(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    if isinstance(prompts, (str, dict)):
        return [_plain_prompt(prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return [_plain_prompt(p) for p in items]


def _plain_prompt(prompt: Prompt) -> str | Sequence[int]:
    """A text or token-id prompt; vLLM's prompt dicts give theirs. TypeError for a dict of neither kind."""
    if not isinstance(prompt, dict):
        return prompt
    given = [key for key in PROMPT_DICT_KEYS if key in prompt]
    others = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if len(given) != 1 or others:
        raise TypeError(f"a prompt dict takes exactly one of {' or '.join(PROMPT_DICT_KEYS)} (vLLM's TextPrompt / "
                        f"TokensPrompt); got keys {sorted(prompt)}" + (" (kvpilot serves text models only: no "
                                                                        "multi-modal data)" if others else ""))
    return prompt[given[0]]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return params
