"""The runner's side of speculative decoding, model-free: which drafts are accepted, a verifying step's inputs
(each position a decode of its own), and seeded streams rewound to the positions kept."""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.engine.scheduler_output import NewRequestData, ScheduledChunk
from kvpilot.model.input_batch import BatchLimits, InputBatch
from kvpilot.model.sampler import advance_generator
from kvpilot.model.verification import accepted_tokens, finish_verification, plan_verification
from kvpilot.model.verify_inputs import build_verify_inputs
from kvpilot.sampling_params import SamplingParams


def test_accepted_tokens_stop_at_the_first_mismatch():
    ids = [10, 11, 12, 13, 20, 21]  # one request's 4 rows, then another's 2
    assert accepted_tokens(ids, 0, [10, 11, 99]) == [10, 11, 12]  # 2 accepted, the target's 12 instead of 99
    assert accepted_tokens(ids, 0, [10, 11, 12]) == [10, 11, 12, 13]  # all accepted, plus the target's 13
    assert accepted_tokens(ids, 0, [5, 11, 12]) == [10]  # the first rejected: the target's own token only
    assert accepted_tokens(ids, 4, [20]) == [20, 21]


def _batch() -> InputBatch:
    batch = InputBatch(BatchLimits(max_num_seqs=4, max_model_len=64, block_size=4))
    for rid, prompt, blocks in (("a", [1, 2, 3, 4, 5, 6], [7, 3]), ("b", [9, 8, 7], [5])):
        batch.add(NewRequestData(rid, prompt, [], SamplingParams(), blocks, len(prompt) - 1))
    return batch


def test_a_verification_runs_as_decodes_at_consecutive_positions():
    batch = _batch()
    rows = np.array([batch.rows["a"], batch.rows["b"]])
    chunks = [ScheduledChunk("a", 5, 3, True), ScheduledChunk("b", 2, 1, True)]
    inputs = build_verify_inputs(batch, chunks, rows, {"a": [40, 41]}, torch.device("cpu"))
    layout = inputs.layout
    assert layout.all_decode and layout.query_lens.tolist() == [1, 1, 1, 1]
    assert layout.start_positions.tolist() == [5, 6, 7, 2]
    assert inputs.token_ids.tolist() == [6, 40, 41, 7]  # a's last known token, its drafts; b's last token
    assert layout.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 2]
    assert inputs.sample_rows.tolist() == [0, 1, 2, 3] and inputs.sample_counts.tolist() == [3, 1]
    assert inputs.sample_request_ids == ["a", "b"] and inputs.logit_batch_rows.tolist() == [0, 0, 0, 1]
    assert batch.num_tokens[rows[0]] == 6  # drafts are not the row's tokens until accepted


def test_kept_tokens_are_appended_and_seeded_streams_rewound():
    batch = _batch()
    rows = np.array([batch.rows["a"], batch.rows["b"]])
    generator = torch.Generator().manual_seed(7)
    verification = plan_verification(np.array([3, 1]), ["a", "b"], {"a": [40, 41]}, {"a": generator})
    for _ in range(3):  # the step drew one uniform per verified position
        advance_generator(generator, 1, torch.device("cpu"))
    positions = batch.append_placeholders(rows)
    ids = [40, 50, 51, 60]  # a: draft 40 accepted, 41 rejected (the target said 50); b: 60
    batch.commit(["a", "b"], rows, positions, np.array([40, 60]))
    verified = finish_verification(batch, verification, ["a", "b"], rows, positions, ids, torch.device("cpu"))
    assert verified == {"a": [40, 50]}
    assert batch.token_ids[rows[0], :8].tolist() == [1, 2, 3, 4, 5, 6, 40, 50]
    assert batch.num_tokens[rows[0]] == batch.num_known[rows[0]] == 8 and batch.num_output[rows[0]] == 2
    expected = torch.Generator().manual_seed(7)
    advance_generator(expected, 2, torch.device("cpu"))  # two tokens kept: two positions' uniforms used
    assert torch.equal(generator.get_state(), expected.get_state())
