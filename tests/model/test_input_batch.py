"""InputBatch's counts of held rows that sample, have min_tokens or want logprobs: the runner skips gathering
those columns when a count is 0, so each must equal what the columns say after any adds and removes (rows are
recycled: a freed row's settings must not leak into the counts or the next request)."""

from __future__ import annotations

import random

from kvpilot import SamplingParams
from kvpilot.engine.scheduler_output import NewRequestData
from kvpilot.model.input_batch import BatchLimits, InputBatch


def _recounted(batch: InputBatch) -> tuple[int, int, int]:
    rows = list(batch.rows.values())
    return (int((batch.temperature[rows] > 0).sum()), int((batch.min_tokens[rows] > 0).sum()),
            int((batch.num_logprobs[rows] >= 0).sum()))


def test_counts_follow_adds_and_removes():
    batch = InputBatch(BatchLimits(max_num_seqs=8, max_model_len=64, block_size=16))
    rng = random.Random(0)
    choices = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(min_tokens=3),
               SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.5, logprobs=0, min_tokens=1)]
    held: list[str] = []
    for step in range(200):
        if held and (len(held) == 8 or rng.random() < 0.4):
            batch.remove(held.pop(rng.randrange(len(held))))
        else:
            request_id = f"r{step}"
            batch.add(NewRequestData(request_id, [1, 2, 3], [], rng.choice(choices), [step % 5], 0))
            held.append(request_id)
        assert (batch.num_sampling, batch.num_min_tokens, batch.num_with_logprobs) == _recounted(batch), step
    for request_id in held:
        batch.remove(request_id)
    assert (batch.num_sampling, batch.num_min_tokens, batch.num_with_logprobs) == (0, 0, 0)
    assert not (batch.temperature > 0).any() and not (batch.min_tokens > 0).any()
    assert (batch.num_logprobs == -1).all()
