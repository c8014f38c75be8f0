"""fp8 KV cache scales (model/kv_scales.py) on a tiny dummy-weight Llama: power-of-two scales fold exactly (the
same logits to the bit on an unquantized cache), the first serving step calibrates them (never a profiling
forward), and on keys too large for fp8's range the calibrated cache tracks the full-precision one while scale 1
saturates. On every attention backend that runs here (Triton under its interpreter on a CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvpilot.engine.scheduler_output import NewRequestData, RunningRequestData, ScheduledChunk, SchedulerOutput
from kvpilot.model.kv_scales import TARGET, attention_modules, make_kv_scales
from kvpilot.model.loader import load_model
from kvpilot.model.quant.checkpoint_tensors import take_kv_cache_scales
from kvpilot.model.runner import ModelRunner
from kvpilot.sampling_params import SamplingParams
from tests.model.triton_cases import ON_GPU, TRITON_SKIP_REASON

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}
PROMPT = [(17 * i + 3) % 500 for i in range(24)]
FP8 = torch.float8_e4m3fn
BACKENDS = ["torch", "cpu", "triton"]


def _steps() -> list[SchedulerOutput]:
    """A 24-token prompt in one step, then a 1-token decode twice (each reads the cache the prompt wrote)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = SchedulerOutput([ScheduledChunk("a", 0, 24, True)],
                            new_requests=[NewRequestData("a", PROMPT, [], greedy, [3, 7, 1, 5, 0, 2, 6, 4], 0)])
    return [first, *(SchedulerOutput([ScheduledChunk("a", 24 + i, 1, True)],
                                     running_requests=[RunningRequestData("a", [], 24 + i)]) for i in range(2))]


def _skip(backend: str) -> None:
    if backend == "triton" and TRITON_SKIP_REASON is not None:
        pytest.skip(TRITON_SKIP_REASON)
    if backend == "cpu" and ON_GPU:
        pytest.skip("the cpu backend runs on a CPU")


def _load(tmp_path, key_gain: float = 1.0):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    loaded = load_model(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=64,
                        device="cuda" if ON_GPU else "cpu")
    if key_gain != 1.0:  # keys far beyond fp8's largest value (448)
        for module in attention_modules(loaded.model):
            rows = slice(module.q_size, module.q_size + module.kv_size)
            module.qkv_proj.weight.data[rows] *= key_gain
    return loaded


def _decode_logits(loaded, backend: str, kv_dtype: torch.dtype | None, calibrate: bool = True,
                   profile_first: bool = False, scales=None) -> tuple[torch.Tensor, ModelRunner]:
    """The decodes' logits after the prompt ran as a serving step (execute_model: calibrates fp8 scales);
    `scales`: given to the runner in place of its own (the fold on another KV dtype)."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=kv_dtype, attention_backend=backend,
                         calibrate_kv_scales=calibrate)
    if scales is not None:
        runner._kv_scales = scales
    first, *decodes = _steps()
    if profile_first:  # a forward that is not a serving step: must leave the scales unset
        runner.forward_logits(first)
        assert not any(s.frozen for s in runner.kv_scales)
        runner = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=kv_dtype, attention_backend=backend,
                             calibrate_kv_scales=calibrate)
    runner.execute_model(first).result()
    return torch.cat([runner.forward_logits(step)[1].cpu() for step in decodes]), runner


@pytest.mark.parametrize("backend", BACKENDS)
def test_power_of_two_scales_fold_exactly(tmp_path, backend):
    """On an unquantized cache, scales change nothing: the same logits to the bit (the fold is exact)."""
    _skip(backend)
    loaded = _load(tmp_path)
    plain, runner = _decode_logits(loaded, backend, None)
    assert runner.kv_scales == []
    scales = make_kv_scales(loaded.model, loaded.dtype, loaded.device)
    for s, k, v in zip(scales.values(), (4.0, 0.25), (0.5, 8.0)):
        s.set_scales(torch.tensor(k), torch.tensor([v, 2 * v]))
    folded, runner = _decode_logits(loaded, backend, None, scales=scales)
    assert torch.equal(folded, plain)


def test_runners_sharing_a_model_keep_their_own_scales(tmp_path):
    """An fp8 runner's scales are its own: a later runner of the same model with another KV dtype (LLM(loaded=
    ...)) computes as if it never existed, and the fp8 runner still has them."""
    loaded = _load(tmp_path, key_gain=2000.0)
    before, _ = _decode_logits(loaded, "torch", None)
    _, fp8_runner = _decode_logits(loaded, "torch", FP8)
    after, _ = _decode_logits(loaded, "torch", None)
    assert torch.equal(after, before) and all(s.frozen and not s.identity for s in fp8_runner.kv_scales)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_first_serving_step_calibrates_and_fp8_keys_beyond_448_need_it(tmp_path, backend):
    _skip(backend)
    loaded = _load(tmp_path, key_gain=2000.0)
    reference, _ = _decode_logits(loaded, backend, None)
    calibrated, runner = _decode_logits(loaded, backend, FP8, profile_first=True)
    at_one, unscaled = _decode_logits(loaded, backend, FP8, calibrate=False)
    assert len(runner.kv_scales) == 2 and all(s.frozen for s in runner.kv_scales)
    for scales in runner.kv_scales:
        assert all(s == 2.0 ** round(torch.log2(s).item()) and s > 448 / TARGET for s in scales.k_scale)
    assert all(torch.equal(s.k_scale, torch.ones(2)) for s in unscaled.kv_scales)
    if backend == "triton" and not ON_GPU:
        pytest.skip("Triton's interpreter rounds float32 to fp8 wrongly across a power of two (7.99 -> 4.0, not "
                    "8.0) and wraps past 448: its fp8 cache is not the GPU's")
    calibrated_error = (calibrated - reference).abs().max().item()
    at_one_error = (at_one - reference).abs().max().item()
    assert calibrated_error < 0.1 * at_one_error, (calibrated_error, at_one_error)
    assert torch.equal(calibrated.argmax(-1), reference.argmax(-1))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU (benchmarks/gpu_checks.sh runs this file there)")
def test_graphs_captured_before_calibration_replay_the_calibrated_scales(tmp_path):
    """Decode graphs are captured at start-up, before the first step sets the scales: they read the scales'
    tensors, updated in place, so a replayed decode equals an eager one."""
    loaded = _load(tmp_path, key_gain=2000.0)
    eager, _ = _decode_logits(loaded, "triton", FP8)
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=FP8, attention_backend="triton")
    runner.capture_decode_graphs([1, 2], max_num_batched_tokens=64)
    first, *decodes = _steps()
    runner.execute_model(first).result()
    assert all(s.frozen and not s.identity for s in runner.kv_scales)
    graphed = torch.cat([runner.forward_logits(step)[1].cpu() for step in decodes])
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


def test_a_checkpoints_scales_are_taken_and_used_instead_of_calibrating(tmp_path):
    """vLLM's and llm-compressor's names for a checkpoint's fp8 KV scales are taken out of its state dict; an
    fp8 runner then uses them (rounded up to powers of two) and the first step calibrates nothing."""
    state = {"model.layers.0.self_attn.k_scale": torch.tensor(3.0), "model.layers.0.self_attn.v_scale": torch.tensor(
        [0.02]), "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(0.25), "model.layers.2.self_attn.kv_scale":
        torch.tensor(6.0), "model.norm.weight": torch.ones(2)}
    scales = take_kv_cache_scales(state)
    assert scales == {0: (3.0, pytest.approx(0.02)), 1: (0.5, 0.25), 2: (6.0, 6.0)}
    assert list(state) == ["model.norm.weight"]
    loaded = dataclasses.replace(_load(tmp_path, key_gain=2000.0), kv_cache_scales={0: (3.0, 0.02), 1: (0.5, 0.25)})
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=FP8, attention_backend="torch")
    runner.execute_model(_steps()[0]).result()
    assert [(s.k_scale.tolist(), s.v_scale.tolist()) for s in runner.kv_scales] == [
        ([4.0, 4.0], [0.03125, 0.03125]), ([0.5, 0.5], [0.25, 0.25])]
