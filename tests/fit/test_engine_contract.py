"""fit and the engine size the KV cache with the same function, so plan and server agree."""

from __future__ import annotations

import pytest

from kvpilot.fit.hardware import DeviceGroup, cpu_device
from kvpilot.fit.kv_cache import kv_cache_bytes_per_block, kv_capacity_for_memory, num_kv_blocks_for_memory
from kvpilot.fit.memory import plan_memory
from kvpilot.fit.model_catalog import get_hf_config, list_models
from kvpilot.fit.model_source import LoadedModel, load_model
from kvpilot.fit.weights import weight_bytes
from kvpilot.fit.workload import FitInputs

BUDGET = 64 * 2**20 + 12345  # an awkward budget: not a whole number of blocks
BLOCK_SIZE = 16
KV_BYTES = 2


def _engine_config(name_or_config: str | dict):  # the loader's torch-free ModelConfig
    config_module = pytest.importorskip("kvpilot.model.config")
    config = get_hf_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    return config_module.from_hf_config(config, "test")


@pytest.mark.slow
def test_predicted_capacity_of_the_embedded_model_equals_the_engine_allocation(embedded_model: LoadedModel) -> None:
    torch = pytest.importorskip("torch")
    from kvpilot.launch.args import EngineArgs
    from kvpilot.launch.build import build_engine

    inputs = FitInputs(kv_cache_dtype="bf16", kv_cache_memory_bytes=BUDGET, block_size=BLOCK_SIZE)
    plan = plan_memory(embedded_model, DeviceGroup(cpu_device(memory_bytes=8 * 2**30)), inputs)

    # The real engine on the embedded GGUF (bf16 KV), given the same budget
    built = build_engine(EngineArgs(dtype="bfloat16", kv_cache_memory=BUDGET, block_size=BLOCK_SIZE,
                                    max_model_len=1024))
    engine = built.engine
    assert built.kv.budget_bytes == BUDGET and built.kv.capacity.num_blocks == plan.num_kv_blocks
    allocated = sum(t.nbytes for t in engine.runner.kv_caches)
    assert plan.num_kv_blocks == engine.runner.num_blocks == engine.scheduler.cache_config.num_blocks > 0
    assert allocated == plan.num_kv_blocks * kv_cache_bytes_per_block(embedded_model.spec, BLOCK_SIZE, KV_BYTES)
    assert allocated <= BUDGET < allocated + kv_cache_bytes_per_block(embedded_model.spec, BLOCK_SIZE, KV_BYTES)
    assert all(t.dtype == torch.bfloat16 for t in engine.runner.kv_caches)


def _num_parameters(cfg) -> int:  # noqa: ANN001 - the parameters the loader's ModelConfig implies
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    if cfg.attention_bias:
        attn += cfg.q_size + 2 * cfg.kv_size
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    per_layer = attn + 3 * h * i + 2 * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * per_layer + h + lm_head


ENGINE_MODELS = ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b", "qwen2.5-72b"]


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_fit_and_engine_config_agree_on_params_and_blocks(name: str) -> None:
    engine_cfg = _engine_config(name)
    model = load_model(name)
    assert _num_parameters(engine_cfg) == model.params.num_total
    assert num_kv_blocks_for_memory(engine_cfg, BUDGET, BLOCK_SIZE, KV_BYTES) == num_kv_blocks_for_memory(
        model.spec, BUDGET, BLOCK_SIZE, KV_BYTES)


@pytest.mark.parametrize("name", [n for n in list_models() if n != "deepseek-v3"])
def test_plan_blocks_equal_the_engine_formula_for_standard_attention(name: str) -> None:
    model = load_model(name)
    inputs = FitInputs(kv_cache_memory_bytes=BUDGET, kv_cache_dtype="bf16")
    plan = plan_memory(model, DeviceGroup(cpu_device(memory_bytes=2**50)), inputs)
    expected = kv_capacity_for_memory(model.spec, BUDGET, BLOCK_SIZE, KV_BYTES, 8192)
    assert plan.num_kv_blocks == expected.num_blocks


def test_a_cpus_auto_dtype_is_the_engines(embedded_model: LoadedModel) -> None:
    """On a CPU, --dtype auto is bf16 where the CPU computes bf16 natively or where every linear weight of a GGUF
    runs packed on the CPU's int8 path, else float32 (as kvpilot resolves it): KV bytes and a dense checkpoint's
    weights follow, on this machine and on either kind of CPU (test_gguf.py: by int8 path)."""
    torch = pytest.importorskip("torch")
    from kvpilot.model.dtypes import resolve_dtype
    from kvpilot.model.loader import int8_path_takes_gguf

    cpu = torch.device("cpu")
    engine_bytes = resolve_dtype("auto", cpu, int8_path_takes_gguf(None, "auto", cpu, "auto", 1)).itemsize
    plan = plan_memory(embedded_model, DeviceGroup(cpu_device(memory_bytes=8 * 2**30)), FitInputs())
    assert plan.kv_dtype_bytes == engine_bytes
    dense = load_model("qwen3-0.6b")
    params = dense.params.num_total
    fast, slow = (weight_bytes(dense, on_gpu=False, cpu_fast_bf16=fast).num_bytes for fast in (True, False))
    assert (fast, slow) == (2 * params, 4 * params)
    assert weight_bytes(dense, on_gpu=True, cpu_fast_bf16=False).num_bytes == 2 * params  # a GPU: the checkpoint's
    assert weight_bytes(dense, dtype="bf16", on_gpu=False, cpu_fast_bf16=False).num_bytes == 2 * params


def test_a_dense_bf16_model_on_an_amx_cpu_notes_the_decode_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this machine's CPU (cpu_fast_bf16 None) with AMX, a dense bf16 model's weights carry the note of the
    prepacked and float32 copies the loader keeps there (model/layers/onednn_linear.py); not on a GPU, not without
    AMX, not in float32."""
    from kvpilot.fit import weights

    dense = load_model("qwen3-0.6b")
    monkeypatch.setattr(weights, "cpu_has_amx_bf16", lambda: True)
    assert weight_bytes(dense, dtype="bf16", on_gpu=False).notes == (weights.AMX_COPIES_NOTE,)
    assert weight_bytes(dense, dtype="bf16", on_gpu=True).notes == ()
    assert weight_bytes(dense, dtype="float32", on_gpu=False).notes == ()
    monkeypatch.setattr(weights, "cpu_has_amx_bf16", lambda: False)
    assert weight_bytes(dense, dtype="bf16", on_gpu=False).notes == ()
