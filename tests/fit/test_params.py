from __future__ import annotations

import pytest

from kvpilot.fit.model_catalog import get_hf_config, list_models
from kvpilot.fit.model_source import load_model
from kvpilot.fit.model_spec import spec_from_hf_config
from kvpilot.fit.params import count_params
from kvpilot.fit.weights import weight_bytes


def test_smollm2_135m_parameter_count_by_hand() -> None:
    # embedding 49152*576 (tied) + 30 layers * (q 576*576 + k,v 2*576*192 + o 576*576 + mlp 3*576*1536
    # + 2 norms * 576) + final norm 576
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536 + 2 * 576
    expected = 49152 * 576 + 30 * per_layer + 576
    assert expected == 134_515_008
    assert load_model("smollm2-135m").params.num_total == expected


def test_llama_3_1_70b_weights_in_bf16_are_about_141_gb() -> None:
    model = load_model("llama-3.1-70b")
    assert model.params.num_total == 70_553_706_496
    assert weight_bytes(model, "bf16").num_bytes == 2 * 70_553_706_496
    assert 141.0e9 < weight_bytes(model, "auto", on_gpu=True).num_bytes < 141.2e9  # the checkpoint's bf16


@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("mixtral-8x7b", 46.70, 12.88),
    ("qwen3-30b-a3b", 30.53, 3.35),
    ("qwen3-235b-a22b", 235.09, 22.19),
    ("deepseek-v3", 671.03, 37.55),
])
def test_moe_total_and_active_parameters(name: str, total_b: float, active_b: float) -> None:
    params = load_model(name).params
    assert params.num_total / 1e9 == pytest.approx(total_b, abs=0.01)
    assert params.num_active / 1e9 == pytest.approx(active_b, abs=0.01)


def test_mixtral_active_parameters_by_hand() -> None:
    p = load_model("mixtral-8x7b").params
    expert = 3 * 4096 * 14336
    assert p.num_params_per_expert == expert
    assert p.num_total - p.num_active == 32 * (8 - 2) * expert  # 6 idle experts in each of 32 layers


def test_dense_models_have_equal_total_and_active() -> None:
    p = load_model("llama-3.1-8b").params
    assert p.num_total == p.num_active == 8_030_261_248


def test_gemma2_ties_embeddings_by_default_and_has_four_norms() -> None:
    spec = spec_from_hf_config(get_hf_config("gemma-2-9b"), "gemma-2-9b")
    assert spec.tie_word_embeddings and spec.norms_per_layer == 4
    assert count_params(spec).num_total == 9_241_705_984


@pytest.mark.slow
@pytest.mark.parametrize("name", list_models())
def test_counts_match_transformers_modules_on_the_meta_device(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = get_hf_config(name)
    hf = transformers.CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "auto_map"})
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf)
    numel = sum(p.numel() for p in module.parameters())
    # DeepSeek-V3's router bias is a buffer in transformers but a tensor in the checkpoint
    numel += sum(b.numel() for n, b in module.named_buffers() if n.endswith("e_score_correction_bias"))
    assert count_params(spec_from_hf_config(config, name)).num_total == numel
