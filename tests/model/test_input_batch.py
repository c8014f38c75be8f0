"""InputBatch's counts of held rows that sample, have min_tokens or want logprobs: the runner skips gathering
those columns when a count is 0, so each must equal what the columns say after any adds and removes (rows are
recycled: a freed row's settings must not leak into the counts or the next request)."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvpilot import SamplingParams
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk
from kvpilot.model.input_batch import BatchLimits, InputBatch
from kvpilot.model.step_inputs import PreviousSample, build_step_inputs


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


def _batch_of(*request_ids: str) -> InputBatch:
    batch = InputBatch(BatchLimits(max_num_seqs=4, max_model_len=64, block_size=16))
    for request_id in request_ids:
        batch.add(NewRequestData(request_id, [5, 6, 7], [], SamplingParams(temperature=0), [0], 3))
    return batch


def test_a_commit_with_no_row_freed_since_its_launch_fills_every_row():
    batch = _batch_of("a", "b")
    rows = np.array([batch.rows["a"], batch.rows["b"]])
    positions = batch.append_placeholders(rows)
    launched = batch.num_removed
    batch.commit(["a", "b"], rows, positions, [11, 12], launched)
    assert batch.token_ids[rows, 3].tolist() == [11, 12] and batch.num_known[rows].tolist() == [4, 4]


def test_a_row_freed_and_taken_since_the_launch_is_not_overwritten():
    """'a' finished after its step launched and 'c' took its row: the commit must skip that row, though the
    caller passes the launch-time count (the fast path applies only while no row was freed)."""
    batch = _batch_of("a", "b")
    rows = np.array([batch.rows["a"], batch.rows["b"]])
    positions = batch.append_placeholders(rows)
    launched = batch.num_removed
    batch.remove("a")
    batch.add(NewRequestData("c", [8, 9, 10, 13, 14], [], SamplingParams(temperature=0), [1], 0))
    assert batch.rows["c"] == rows[0]  # the freed row, recycled
    batch.commit(["a", "b"], rows, positions, [11, 12], launched)
    assert batch.token_ids[rows[0], :5].tolist() == [8, 9, 10, 13, 14]  # c's prompt, untouched
    assert batch.token_ids[rows[1], 3] == 12 and batch.num_known[rows[0]] == 5


def test_previous_sample_finds_each_rows_index_and_minus_one_for_the_rest():
    previous = PreviousSample(torch.tensor([40, 41, 42]), np.array([5, 0, 2]))
    assert previous.index_of(np.array([0, 2, 5, 1, 9])).tolist() == [1, 2, 0, -1, -1]


def test_tokens_in_flight_come_from_the_previous_step_until_their_commit():
    """A step launched before the previous one's ids are committed reads those tokens from the previous
    step's device tensor; once committed (no step in flight) it reads them from the host rows."""
    batch = _batch_of("a", "b")
    rows = np.array([batch.rows["a"], batch.rows["b"]])
    positions = batch.append_placeholders(rows)
    assert batch.num_steps_in_flight == 1
    previous = PreviousSample(torch.tensor([21, 22]), rows)
    batch.num_computed[rows] = positions  # the placeholders are the next step's inputs
    chunks = [ScheduledChunk("a", 3, 1, True), ScheduledChunk("b", 3, 1, True)]
    inputs = build_step_inputs(batch, chunks, rows, previous, torch.device("cpu"))
    assert inputs.token_ids.tolist() == [21, 22] and inputs.positions.tolist() == [3, 3]
    batch.commit(["a", "b"], rows, positions, [31, 32], batch.num_removed)
    assert batch.num_steps_in_flight == 0
    inputs = build_step_inputs(batch, chunks, rows, None, torch.device("cpu"))  # no previous step needed
    assert inputs.token_ids.tolist() == [31, 32]


def _assert_same_inputs(fast, general) -> None:
    for name in ("token_ids", "positions", "sample_rows"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
    assert fast.sample_request_ids == general.sample_request_ids
    assert fast.sample_batch_rows.tolist() == general.sample_batch_rows.tolist()
    for name in ("query_start", "query_lens", "start_positions", "block_tables", "slot_mapping", "context_lens",
                 "is_decode"):
        assert getattr(fast.layout, name).tolist() == getattr(general.layout, name).tolist(), name
    assert fast.layout.all_decode and general.layout.all_decode


def test_the_decode_path_builds_what_the_general_path_builds():
    """build_step_inputs(decodes=True), the runner's path for a step the scheduler's counts show is all
    decodes, against the general path: rows out of order, positions on both sides of block boundaries, random
    block placement, with and without tokens still in flight."""
    rng = random.Random(3)
    batch = InputBatch(BatchLimits(max_num_seqs=8, max_model_len=64, block_size=4))
    lengths = {"a": 4, "b": 5, "c": 8, "d": 13, "e": 2, "f": 16}  # next positions 3, 4, 7, 12, 1, 15
    for request_id, length in lengths.items():
        blocks = rng.sample(range(40), 5)
        batch.add(NewRequestData(request_id, [rng.randrange(100) for _ in range(length)], [],
                                 SamplingParams(temperature=0), blocks, length - 1))
    order = ["d", "a", "f", "c", "e", "b"]
    chunks = [ScheduledChunk(r, lengths[r] - 1, 1, True) for r in order]
    rows = np.array([batch.rows[r] for r in order])
    cpu = torch.device("cpu")
    _assert_same_inputs(build_step_inputs(batch, chunks, rows, None, cpu, decodes=True),
                        build_step_inputs(batch, chunks, rows, None, cpu))
    positions = batch.append_placeholders(rows)  # one step in flight: its tokens are the next inputs
    previous = PreviousSample(torch.tensor([50 + i for i in range(len(rows))]), rows)
    batch.num_computed[rows] = positions
    chunks = [ScheduledChunk(r, lengths[r], 1, True) for r in order]
    fast = build_step_inputs(batch, chunks, rows, previous, cpu, decodes=True)
    _assert_same_inputs(fast, build_step_inputs(batch, chunks, rows, previous, cpu))
    assert fast.token_ids.tolist() == [50 + i for i in range(len(rows))]
