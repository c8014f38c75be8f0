"""The paged cache gives the same logits whatever the block layout and however a prompt is split:
one prefill, chunked prefill over scattered blocks, or token-by-token decode, mixed in one batch."""

from __future__ import annotations

import torch

from kvpilot.engine.scheduler_output import ScheduledChunk
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner

PROMPT = [(13 * i + 5) % 400 for i in range(45)]


def test_same_logits_for_any_layout_and_split():
    loaded = load_model("dummy:smollm2-135m", dtype="float32", max_model_len=256)
    loaded.model.layers = loaded.model.layers[:4]  # fewer layers: the cache logic is per layer anyway
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    contiguous = list(range(12))
    scattered = [31, 2, 17, 9, 25, 4, 30, 11, 20, 6, 15, 28]
    decode_blocks = [1, 3, 5, 7, 8, 10, 12, 13, 14, 16, 18, 19]

    _, whole = runner.execute([ScheduledChunk("a", PROMPT, 0, contiguous, True)])
    # chunked prefill (20 + 25) in scattered blocks, batched together with a token-by-token decode of the same prompt
    runner.execute([ScheduledChunk("b", PROMPT[:20], 0, scattered, False)])
    for pos in range(44):
        runner.execute([ScheduledChunk("c", [PROMPT[pos]], pos, decode_blocks, False)])
    ids, logits = runner.execute([ScheduledChunk("b", PROMPT[20:], 20, scattered, True),
                                  ScheduledChunk("c", [PROMPT[44]], 44, decode_blocks, True)])
    assert ids == ["b", "c"]
    torch.testing.assert_close(logits[0], whole[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], whole[0], rtol=1e-4, atol=1e-4)
