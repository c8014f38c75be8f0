"""Piecewise CUDA graphs (kvpilot.model.piecewise_graphs): steps with prompt tokens replay the forward's pieces
between attention calls, attention running eagerly on the real rows.

On a CPU the pieces run eagerly over the same static buffers and breakpoints, so padding, the shared
attention-output buffer and the bucket choice are checked here against the eager runner (and, per family,
against HF transformers: tests/model/test_gemma.py, test_moe.py); with a GPU the same test captures and
replays real graphs (benchmarks/gpu_checks.sh's `tests` stage). Also: `--compilation-config` as vLLM
spells it, and which graphs an engine plans for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.launch.args import EngineArgs
from kvpilot.launch.graphs import CUDA_GRAPH_BYTES_PER_SIZE, graph_plan, piecewise_pool_bytes
from kvpilot.model.compilation_config import CompilationConfig, default_piecewise_sizes
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams
from tests.model.test_cuda_graphs import BLOCK_SIZE, REQUESTS, _loaded
from tests.model.triton_cases import TRITON_SKIP_REASON

GREEDY = SamplingParams(temperature=0)


def test_default_sizes_pad_at_most_an_eighth_from_64_tokens():
    sizes = default_piecewise_sizes(2048)
    assert sizes[:8] == [8, 16, 24, 32, 40, 48, 56, 64] and sizes[-3:] == [1792, 1920, 2048]
    assert all(b - a <= max(8, a // 8) for a, b in zip(sizes, sizes[1:]))
    assert default_piecewise_sizes(100) == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]
    config = CompilationConfig.of({"max_cudagraph_capture_size": 512})
    assert config.piecewise_sizes(16384)[-1] == 512 and config.piecewise_sizes(300)[-1] == 300  # the budget caps
    assert CompilationConfig.of('{"cudagraph_capture_sizes": [64, 8, 4096]}').piecewise_sizes(2048) == [8, 64]


def test_compilation_config_is_vllms_and_says_what_it_takes():
    assert CompilationConfig.of(None) == CompilationConfig() and CompilationConfig().full_decode
    piecewise = CompilationConfig.of('{"cudagraph_mode": "piecewise"}')
    assert piecewise.piecewise and not piecewise.full_decode
    decode_only = CompilationConfig.of({"cudagraph_mode": "FULL_DECODE_ONLY"})
    assert decode_only.full_decode and not decode_only.piecewise
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE replays their pieces"):
        CompilationConfig.of({"cudagraph_mode": "FULL"})
    with pytest.raises(ValueError, match=r"\['level'\] are not supported.*cudagraph_mode"):
        CompilationConfig.of({"level": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        CompilationConfig.of("{cudagraph_mode: NONE}")
    with pytest.raises(ValueError, match="positive integers"):
        CompilationConfig.of({"cudagraph_capture_sizes": [8, 0]})
    with pytest.raises(EngineConfigError, match="cudagraph_mode"):
        EngineArgs(compilation_config='{"cudagraph_mode": "ALL"}').check()
    with pytest.raises(EngineConfigError, match="give one of them"):
        EngineArgs(cuda_graph_sizes=(8,), compilation_config={"cudagraph_capture_sizes": [8]}).check()


def _fake_loaded(device: str, config) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16, config=config)


def test_graph_plan_follows_the_mode_backend_and_model(tmp_path):
    config = _loaded(tmp_path).config
    cuda = _fake_loaded("cuda", config)

    def plan(hybrid=False, **kwargs):
        return graph_plan(EngineArgs(max_num_seqs=64, **kwargs), cuda, torch.bfloat16, 4096, hybrid=hybrid)

    assert plan(enforce_eager=True).decode_sizes == plan(enforce_eager=True).piecewise_sizes == ()
    assert graph_plan(EngineArgs(), _fake_loaded("cpu", config), torch.bfloat16, 4096, hybrid=False).off_reasons == ()
    torch_backend = plan(attention_backend="torch")  # pieces run any backend's attention; decode graphs need Triton
    assert torch_backend.decode_sizes == () and torch_backend.piecewise_sizes[-1] == 2048
    assert "triton" in torch_backend.off_reasons[0]
    hybrid = plan(hybrid=True, compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert hybrid.decode_sizes == () and hybrid.off_reasons == () and len(hybrid.piecewise_sizes) == 48
    assert plan(tensor_parallel_size=2, quantization="none").piecewise_sizes == ()
    if TRITON_SKIP_REASON is None:  # triton imports: the default mode plans both kinds
        both = plan()
        assert both.decode_sizes[-1] == 64 and both.piecewise_sizes[-1] == 2048
        pieces = len(both.piecewise_sizes) * (config.num_hidden_layers + 1)
        assert both.set_aside_bytes(config, 2) > CUDA_GRAPH_BYTES_PER_SIZE * len(both.decode_sizes) + pieces
        assert piecewise_pool_bytes(config, 2, 2048) == 2 * piecewise_pool_bytes(config, 2, 1024)


def _mixed_run(runner: ModelRunner) -> list[torch.Tensor]:
    """Prompts of REQUESTS arriving over the steps beside the others' decodes (mixed steps of 5-13 tokens);
    the logits of each step."""
    lengths: dict[str, int] = {}
    logits = []
    for step, arriving in enumerate([REQUESTS[:2], REQUESTS[2:4], REQUESTS[4:], [], []]):
        news = [NewRequestData(rid, [(5 * step + 3 * i + len(rid)) % 500 for i in range(n)], [], GREEDY, blocks, 0)
                for rid, n, blocks in arriving]
        chunks = [ScheduledChunk(rid, lengths[rid], 1, True) for rid in lengths]
        running = [RunningRequestData(c.request_id, [], c.start_position) for c in chunks]
        chunks += [ScheduledChunk(rid, 0, n, True) for rid, n, _ in arriving]
        output = SchedulerOutput(chunks, new_requests=news, running_requests=running)
        logits.append(runner.forward_logits(output)[1].cpu())
        for chunk in chunks:
            lengths[chunk.request_id] = chunk.start_position + chunk.num_tokens
    return logits


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_piecewise_steps_give_the_eager_logits(tmp_path, backend):
    if backend == "triton" and TRITON_SKIP_REASON is not None:
        pytest.skip(TRITON_SKIP_REASON)
    loaded = _loaded(tmp_path)
    if backend == "cpu" and loaded.device.type != "cpu":
        pytest.skip("the C++ backend runs on a CPU")
    eager = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend=backend)
    graphed = ModelRunner(loaded, num_blocks=17, block_size=BLOCK_SIZE, attention_backend=backend)
    graphed.capture_piecewise_graphs([4, 8, 16])
    used: list[tuple[int, int]] = []
    forward = graphed.piecewise.forward
    graphed.piecewise.forward = lambda ids, pos, attn, size: used.append((len(ids), size)) or \
        forward(ids, pos, attn, size)
    expected = _mixed_run(eager)
    got = _mixed_run(graphed)
    assert used == [(12, 16), (13, 16), (6, 8), (5, 8), (5, 8)]  # two prompts; four decodes + two prompts; ...
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert graphed.piecewise.size_for(17) is None and graphed.piecewise.size_for(1) == 4


def test_a_replay_that_computes_something_else_is_never_served(tmp_path, monkeypatch, caplog):
    """The capture's own check (PiecewiseGraphs.check): pieces that lose attention's output (a stand-in for a
    replay bug) differ from the eager forward, so capture_graphs logs it and those steps run eagerly."""
    import logging

    from kvpilot.launch.graphs import GraphPlan, capture_graphs
    from kvpilot.model import piecewise_graphs

    runner = ModelRunner(_loaded(tmp_path), num_blocks=17, block_size=BLOCK_SIZE, attention_backend="torch")
    monkeypatch.setattr(piecewise_graphs._Breakpoints, "__call__",
                        lambda self, q, k, v, kv_cache, layer: self.owner.attention_out(q, self.size).zero_())
    with caplog.at_level(logging.WARNING, logger="kvpilot"):
        capture_graphs(runner, GraphPlan(piecewise_sizes=(8, 16)), max_num_batched_tokens=64)
    assert runner.piecewise is None
    assert any("piecewise CUDA graph capture failed" in r.getMessage() and "off the eager forward" in r.getMessage()
               for r in caplog.records)
