"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read back) gives the same
outputs as synchronous mode on the real model: chunked prefill, prefix-cache hits, stop strings found one
step late, EOS, and preemptions under KV pressure, all in one workload of 64 requests."""

from __future__ import annotations

import pytest

from kvpilot import LLM, SamplingParams
from tests.engine_e2e.conftest import assert_no_leak

pytestmark = pytest.mark.slow


# A step's token budget under the longest prompt's length: those prompts are prefilled in chunks.
MAX_NUM_BATCHED_TOKENS = 64


def _workload(corpus_ids: list[int], mixed_prompts: list[list[int]], tokenizer) -> tuple[list, list]:
    """32 mixed prompts (the e2e mixed prompts cut to half: 1 to 100 tokens; greedy, ignore_eos) + 32
    sharing a 64-token prefix (4 blocks), half of them with stop strings (" the", ",", "."; they do stop: the
    test counts them), the rest stopping at EOS or max_tokens. Prefill is most of the cost on a CPU, so the
    prompts are short; the KV cache is sized to them so that requests are still preempted."""
    shared = corpus_ids[:64]
    prompts = [p[:max(1, len(p) // 2)] for p in mixed_prompts]
    prompts += [shared + corpus_ids[300 + 9 * i: 304 + 9 * i] for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 32
    for i in range(32):
        stop = [" the", ",", "."] if i % 2 else []
        params.append(SamplingParams(temperature=0, max_tokens=10 + i % 7, stop=stop))
    return prompts, params


def _run(llm_fp32: LLM, prompts, params, async_scheduling: bool):
    # fp32 KV is 46,080 bytes per token: 24MiB holds ~540 tokens, a quarter of what the 64 requests need at once
    llm = LLM(loaded=llm_fp32.loaded, kv_cache_memory="24MiB", max_model_len=128,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=64, async_scheduling=async_scheduling)
    assert llm.engine.async_scheduling is async_scheduling
    outputs = llm.generate(prompts, params)
    assert_no_leak(llm)
    return outputs, llm.engine.scheduler.make_stats()


def test_async_and_sync_scheduling_give_identical_outputs(llm_fp32, corpus_ids, mixed_prompts):
    prompts, params = _workload(corpus_ids, mixed_prompts, llm_fp32.tokenizer)
    assert len(prompts) == 64 and max(len(p) for p in prompts) > MAX_NUM_BATCHED_TOKENS  # chunked prefill
    sync_outputs, sync_stats = _run(llm_fp32, prompts, params, async_scheduling=False)
    async_outputs, async_stats = _run(llm_fp32, prompts, params, async_scheduling=True)

    def view(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in outputs]

    assert view(async_outputs) == view(sync_outputs)
    # the workload really exercised what it claims, in both modes
    for stats in (sync_stats, async_stats):
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    stop_reasons = [o.outputs[0].stop_reason for o in async_outputs]
    assert sum(isinstance(r, str) for r in stop_reasons) >= 8  # stop strings matched (one step late in async)
    assert all(len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(async_outputs, params))
