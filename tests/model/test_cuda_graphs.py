"""Decode steps through CUDA graphs (kvpilot.model.cuda_graphs) give the eager forward's tokens and logits.

On a CPU the graph runner keeps the captured closure over its static buffers and calls it (Triton's
interpreter runs the kernels), so the padding rows, the fixed-offset metadata, the static token ids (taken
on the device from the previous step's samples) and the bucket choice are checked here; a GPU run checks
the capture itself (benchmarks/gpu_checks.sh)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.choices import cuda_graph_sizes
from kvpilot.model.cuda_graphs import padded_decode_layout
from kvpilot.model.loader import load_model
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

triton_only = pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "torch_dtype": "float32"}
BLOCK_SIZE = 4
# (request id, prompt length, its blocks: scattered, enough for prompt + 8 decodes)
REQUESTS = [("a", 9, [9, 2, 14, 5]), ("b", 3, [3, 15, 7]), ("c", 6, [11, 0, 13, 1]), ("d", 5, [6, 8, 4]),
            ("e", 2, [10, 12, 16])]


def test_default_sizes_cover_every_batch():
    assert cuda_graph_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert cuda_graph_sizes(100)[-3:] == [80, 96, 100]
    assert cuda_graph_sizes(3) == [1, 2, 3]
    assert cuda_graph_sizes(64, [8, 1, 512, 8]) == [1, 8, 64]  # as given, deduplicated, clipped
    with pytest.raises(ValueError, match="positive"):
        cuda_graph_sizes(64, [0, 4])


def test_padding_rows_decode_nothing_real():
    layout = StepLayout(query_start=np.arange(3), query_lens=np.ones(3, dtype=np.int64),
                        start_positions=np.array([5, 9, 1]), block_tables=np.array([[4, 2, 0], [7, 1, 3], [8, 0, 0]]),
                        slot_mapping=np.array([9, 13, 33]), block_size=4)
    padded = padded_decode_layout(layout, 8)
    assert padded.is_decode.all() and padded.num_tokens == 8
    assert padded.slot_mapping.tolist() == [9, 13, 33] + [-1] * 5  # padding K/V is never written
    assert padded.start_positions[:3].tolist() == [5, 9, 1] and (padded.context_lens[3:] == 2).all()
    assert (padded.block_tables[:3] == layout.block_tables).all() and not padded.block_tables[3:].any()


def test_metadata_buffer_never_moves_once_frozen():
    from kvpilot.model.device_staging import FrozenBufferError, PackedArrays

    packed = PackedArrays(torch.device("cpu"), 64)
    buffer = packed.buffer
    packed.freeze()
    packed.pack([np.arange(40, dtype=np.int32)])
    assert packed.buffer is buffer
    with pytest.raises(FrozenBufferError, match="enforce-eager"):
        packed.pack([np.arange(buffer.numel() + 1, dtype=np.int32)])


def _loaded(tmp_path):
    config = {**get_hf_config("qwen3-0.6b"), **SMALL}
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=48,
                      device="cuda" if ON_GPU else "cpu")


def _decode_run(runner: ModelRunner, num_steps: int) -> list[dict[str, int]]:
    """Prefills REQUESTS, then decodes them: all five, then (after 'e' finishes) four, each step sampling
    greedily (each decode's input is the previous step's sample, taken on the device). Tokens per step."""
    news = [NewRequestData(rid, [(7 * len(rid) + 3 * i) % 500 for i in range(n)], [], SamplingParams(temperature=0),
                           blocks, 0) for rid, n, blocks in REQUESTS]
    runner.execute_model(SchedulerOutput([ScheduledChunk(rid, 0, n, True) for rid, n, _ in REQUESTS],
                                         new_requests=news)).result()
    lengths = {rid: n for rid, n, _ in REQUESTS}
    tokens = []
    for step in range(num_steps):
        live = [rid for rid in lengths if not (rid == "e" and step >= 3)]
        finished = ["e"] if step == 3 else []
        chunks = [ScheduledChunk(rid, lengths[rid], 1, True) for rid in live]
        output = SchedulerOutput(chunks, running_requests=[RunningRequestData(c.request_id, [], c.start_position)
                                                           for c in chunks], finished_request_ids=finished)
        tokens.append(runner.execute_model(output).result().token_ids)
        for rid in live:
            lengths[rid] += 1
        if finished:
            lengths.pop("e")
    return tokens


@triton_only
def test_graph_replays_give_the_eager_tokens(tmp_path):
    loaded = _loaded(tmp_path)
    eager = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend="triton")
    graphed = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend="triton")
    graphed.capture_decode_graphs([1, 2, 8], max_num_batched_tokens=64)
    used: list[int] = []
    forward = graphed.graphs.forward
    graphed.graphs.forward = lambda *args: used.append(args[-1]) or forward(*args)
    eager_tokens = _decode_run(eager, 6)
    graph_tokens = _decode_run(graphed, 6)
    assert graph_tokens == eager_tokens
    assert used == [8] * 6  # 5 then 4 decodes, each padded up to the graph of 8; the prompt step ran eagerly
    assert len(eager_tokens[0]) == 5 and len(eager_tokens[-1]) == 4


@triton_only
def test_graph_logits_match_eager(tmp_path):
    loaded = _loaded(tmp_path)
    runners = [ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend="triton")
               for _ in range(2)]
    runners[1].capture_decode_graphs([2, 4], max_num_batched_tokens=64)
    results = []
    for runner in runners:
        news = [NewRequestData(rid, list(range(1, n + 1)), [], SamplingParams(), blocks, 0)
                for rid, n, blocks in REQUESTS[:3]]
        runner.forward_logits(SchedulerOutput([ScheduledChunk(rid, 0, n - 1, False) for rid, n, _ in REQUESTS[:3]],
                                              new_requests=news))
        chunks = [ScheduledChunk(rid, n - 1, 1, True) for rid, n, _ in REQUESTS[:3]]  # 3 decodes: the graph of 4
        running = [RunningRequestData(c.request_id, [], c.start_position) for c in chunks]
        results.append(runner.forward_logits(SchedulerOutput(chunks, running_requests=running))[1].cpu())
    assert runners[1].graphs.size_for(padded_decode_layout(_three_decodes(), 3)) == 4
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def _three_decodes() -> StepLayout:
    return StepLayout(np.arange(3), np.ones(3, dtype=np.int64), np.array([9, 3, 6]), np.zeros((3, 4), dtype=np.int64),
                      np.arange(3), BLOCK_SIZE)


def test_cuda_graph_flags_are_checked_before_loading():
    import typer

    from kvpilot.cli_options import parse_cuda_graph_sizes
    from kvpilot.engine.config import EngineConfigError
    from kvpilot.launch.args import EngineArgs

    assert parse_cuda_graph_sizes("1,2, 4 8") == (1, 2, 4, 8)
    assert parse_cuda_graph_sizes(None) is None
    with pytest.raises(typer.BadParameter, match="positive integers"):
        parse_cuda_graph_sizes("1,two")
    with pytest.raises(EngineConfigError, match="positive"):
        EngineArgs(cuda_graph_sizes=(0, 8)).check()


def test_staged_inputs_give_the_same_tokens(tmp_path):
    """The CUDA input path (token ids, positions and sample rows as int32 views of one staged copy, the
    previous step's samples patched in on the device) decodes the same tokens as the CPU path."""
    from kvpilot.model.device_staging import PackedArrays

    loaded = _loaded(tmp_path)
    plain = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend="torch")
    staged = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend="torch")
    staged._staging = PackedArrays(loaded.device)  # what a CUDA runner holds
    assert _decode_run(staged, 5) == _decode_run(plain, 5)
    assert staged._staging.buffer.dtype == torch.int32 and staged._staging.buffer.numel() >= 4 * 5
