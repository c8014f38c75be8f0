"""The paged cache gives the same logits whatever the block layout and however a prompt is split:
one prefill, chunked prefill over scattered blocks, or token-by-token decode, mixed in one batch."""

from __future__ import annotations

import torch

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams

PROMPT = [(13 * i + 5) % 400 for i in range(45)]


def _new(request_id: str, blocks: list[int], num_tokens: int, sample: bool) -> SchedulerOutput:
    new = NewRequestData(request_id, PROMPT, [], SamplingParams(), blocks, 0)
    return SchedulerOutput([ScheduledChunk(request_id, 0, num_tokens, sample)], new_requests=[new])


def _running(*chunks: ScheduledChunk) -> SchedulerOutput:
    return SchedulerOutput(list(chunks), running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                           for c in chunks])


def test_same_logits_for_any_layout_and_split():
    loaded = load_model("dummy:smollm2-135m", dtype="float32", max_model_len=256)
    loaded.model.layers = loaded.model.layers[:4]  # fewer layers: the cache logic is per layer anyway
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    contiguous = list(range(12))
    scattered = [31, 2, 17, 9, 25, 4, 30, 11, 20, 6, 15, 28]
    decode_blocks = [1, 3, 5, 7, 8, 10, 12, 13, 14, 16, 18, 19]

    _, whole = runner.forward_logits(_new("a", contiguous, len(PROMPT), True))
    # chunked prefill (20 + 25) in scattered blocks, batched together with a token-by-token decode of the same prompt
    runner.forward_logits(_new("b", scattered, 20, False))
    runner.forward_logits(_new("c", decode_blocks, 1, False))
    for pos in range(1, 44):
        runner.forward_logits(_running(ScheduledChunk("c", pos, 1, False)))
    ids, logits = runner.forward_logits(_running(ScheduledChunk("b", 20, 25, True), ScheduledChunk("c", 44, 1, True)))
    assert ids == ["b", "c"]
    torch.testing.assert_close(logits[0], whole[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], whole[0], rtol=1e-4, atol=1e-4)
