"""A step that verifies drafts: its inputs, with each verifying request computed as 1 + k decodes.

A request verifying k drafts computes its last known token (position p) and the drafts (positions p + 1 ..
p + k) and samples after each. Rather than a k + 1 token prompt chunk, each of those tokens runs as a decode
of its own: query length 1 at position p + j, attending over the request's block table up to itself. Every
backend writes the whole step's K/V before it attends (so decode j reads drafts 0 .. j - 1 written in the
same step), and a step of decodes and verifications is an all-decode step: it takes the decode kernels,
the CPU's fused decode and int8 path, and CUDA graphs. Each verified position is thus computed exactly as
plain decoding computes it in a batch of that many rows, which keeps greedy output token-identical with
and without speculation as far as batching itself does (tests/engine_e2e).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvpilot.engine.scheduler_output import ScheduledChunk
from kvpilot.model.device_staging import PackedArrays
from kvpilot.model.input_batch import InputBatch
from kvpilot.model.step_inputs import StepInputs, flatten_step


class VerifyOrderError(RuntimeError):
    """A step with drafts for requests whose latest tokens are still on the device: verification needs
    synchronous scheduling (launch/args.py refuses async scheduling with speculation)."""


def build_verify_inputs(batch: InputBatch, chunks: Sequence[ScheduledChunk], rows: np.ndarray,
                        drafts: dict[str, list[int]], device: torch.device,
                        staging: PackedArrays | None = None) -> StepInputs:
    """The step's inputs (StepInputs.sample_counts set): a chunk with drafts becomes 1 + k one-token
    sequences at consecutive positions, sampling each; others stay as they are. Writes the drafts into their
    rows' token ids (InputBatch.write_drafts), where the step reads its inputs."""
    if not bool((batch.num_known[rows] == batch.num_tokens[rows]).all()):
        raise VerifyOrderError("a step verifying drafts needs every token of its requests on the host: "
                               "speculative decoding runs with synchronous scheduling")
    seq_rows: list[int] = []
    seq_starts: list[int] = []
    seq_lens: list[int] = []
    seq_samples: list[bool] = []
    sample_request_ids: list[str] = []
    sample_batch_rows: list[int] = []
    sample_counts: list[int] = []
    for chunk, row in zip(chunks, rows.tolist()):  # a Python loop: verifying steps are small batches
        chunk_drafts = drafts.get(chunk.request_id)
        start = chunk.start_position
        if chunk_drafts:
            batch.write_drafts(row, chunk_drafts)
            n = len(chunk_drafts) + 1
            seq_rows += [row] * n
            seq_starts += range(start, start + n)
            seq_lens += [1] * n
            seq_samples += [True] * n
        else:
            n = 1
            seq_rows.append(row)
            seq_starts.append(start)
            seq_lens.append(chunk.num_tokens)
            seq_samples.append(chunk.needs_sample)
        if chunk.needs_sample:
            sample_request_ids.append(chunk.request_id)
            sample_batch_rows.append(row)
            sample_counts.append(n)
    flat = flatten_step(batch, np.array(seq_rows, dtype=np.int64), np.array(seq_starts, dtype=np.int64),
                        np.array(seq_lens, dtype=np.int64), np.array(seq_samples, dtype=bool), None, device, staging,
                        all_known=True)
    return StepInputs(token_ids=flat.token_ids, positions=flat.positions, layout=flat.layout,
                      sample_rows=flat.sample_rows, sample_request_ids=sample_request_ids,
                      sample_batch_rows=np.array(sample_batch_rows, dtype=np.int64),
                      sample_counts=np.array(sample_counts, dtype=np.int64))
