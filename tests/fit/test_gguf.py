"""The embedded SmolLM2-135M GGUF: the planner's numbers against the file's real tensor table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.fit.errors import ConfigError
from kvpilot.fit.gguf_holding import int8_path_takes_all
from kvpilot.fit.gguf_mixes import mix_tensors
from kvpilot.fit.model_source import LoadedModel, load_model
from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.memory import plan_memory
from kvpilot.fit.roofline import weights_read_bytes
from kvpilot.fit.weights import weight_bytes
from kvpilot.fit.workload import FitInputs

pytestmark = pytest.mark.slow


def test_parameter_count_matches_the_gguf_tensor_sizes_exactly(embedded_model: LoadedModel) -> None:
    assert embedded_model.gguf is not None
    assert embedded_model.gguf.num_params == 134_515_008
    assert embedded_model.params.num_total == embedded_model.gguf.num_params
    assert load_model("smollm2-135m").params.num_total == embedded_model.gguf.num_params


def test_gguf_spec_agrees_with_the_catalog(embedded_model: LoadedModel) -> None:
    catalog = load_model("smollm2-135m").spec
    spec = embedded_model.spec
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")
    assert {f: getattr(spec, f) for f in fields} == {f: getattr(catalog, f) for f in fields}


def test_gguf_weight_bytes_are_the_files_tensor_bytes(embedded_model: LoadedModel, gguf_path: Path) -> None:
    g = embedded_model.gguf
    assert g is not None
    assert g.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    # Q8_0 embedding: 49152*576 weights in blocks of 32 stored in 34 bytes
    assert g.num_bytes_embedding == 49152 * 576 // 32 * 34
    assert g.num_bytes_lm_head == 0  # tied
    assert g.num_bytes < gguf_path.stat().st_size < g.num_bytes + 8 * 2**20  # plus header and tokenizer


def test_gguf_weight_bytes_are_what_kvpilot_holds(embedded_model: LoadedModel) -> None:
    """On a CPU with AVX-512 VNNI in bf16: the Q4_1 layers packed (tiled int8 copies: the blocks' 20 bytes per 32),
    the tied head a packed Q8_0 copy of its blocks' 34 bytes per 32 (the offsets derived from the scales), the
    embedding table dense in bf16; on AVX2 without VNNI, and without either, the same bytes."""
    weights = weight_bytes(embedded_model, cpu_int8="vnni", cpu_fast_bf16=True)
    assert weights.num_bytes_file == embedded_model.gguf.num_bytes
    assert weights.format_name.endswith("held packed")
    assert weights.num_bytes_embedding == 49152 * 576 * 2
    assert weights.num_bytes_lm_head == 49152 * 576 // 32 * 34
    linear = embedded_model.params.num_linear_total
    assert weights.num_bytes_layers == linear // 32 * 20 + 2 * embedded_model.params.num_vector  # norms in bf16
    # a decode step reads the packed layers and the packed head, not the dense lookup table (this machine's CPU)
    plan = plan_memory(embedded_model, parse_device_arg("cpu"), FitInputs())
    here = weight_bytes(embedded_model)
    assert weights_read_bytes(embedded_model, plan, 1) == here.num_bytes_layers + here.num_bytes_lm_head
    assert weight_bytes(embedded_model, cpu_int8="avx2", cpu_fast_bf16=True) == weights
    assert weight_bytes(embedded_model, cpu_int8="none", cpu_fast_bf16=True).num_bytes_lm_head == 49152 * 576 // 32 * 34
    on_gpu = weight_bytes(embedded_model, on_gpu=True)  # kvpilot dequantizes GGUF weights on GPUs
    assert on_gpu.num_bytes == 2 * 134_515_008 and "on a GPU it dequantizes them" in on_gpu.notes[0]


def test_auto_is_bf16_where_every_linear_weight_runs_on_the_int8_path(embedded_model: LoadedModel) -> None:
    """The embedded file (Q4_1, a Q8_0 head), a Q4_K_M mix and IQ4_XS layers run whole on the int8 path of VNNI and
    AVX2 CPUs; a CPU without native bf16 then plans --dtype auto in bf16 (2-byte KV) exactly where the int8 path
    takes it all."""
    spec = embedded_model.spec
    q4_k_m = mix_tensors(spec, "q4_k_m")
    iq4_xs_down = tuple(replace(t, type_name="IQ4_XS") if "ffn_down" in t.name else t  # 1,536 values: whole blocks
                        for t in embedded_model.gguf.tensors)
    takes = {(name, path): int8_path_takes_all(tensors, spec.model_type, spec.tie_word_embeddings, path)
             for name, tensors in (("file", embedded_model.gguf.tensors), ("q4_k_m", q4_k_m),
                                   ("iq4_xs", iq4_xs_down))
             for path in ("vnni", "avx2", "none")}
    assert [k for k, v in takes.items() if v] == [(name, path) for name in ("file", "q4_k_m", "iq4_xs")
                                                  for path in ("vnni", "avx2")]
    computed = {path: weight_bytes(embedded_model, cpu_int8=path, cpu_fast_bf16=False).num_bytes_embedding
                for path in ("avx2", "none")}
    assert computed == {"avx2": 49152 * 576 * 2, "none": 49152 * 576 * 4}  # the dense table in the compute dtype


def test_requantizing_a_gguf_model_uses_the_formula(embedded_model: LoadedModel) -> None:
    assert weight_bytes(embedded_model, "bf16").num_bytes == 2 * 134_515_008


def test_a_corrupt_gguf_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ConfigError, match=r"bad\.gguf"):
        load_model(str(bad))


def test_a_gguf_cut_inside_its_vocabulary_is_a_config_error(tmp_path: Path, gguf_path: Path) -> None:
    """The bulk reader of string arrays runs past the end of a file cut inside its token list: the same
    one-line error as any corrupt file, naming it, not a struct error."""
    cut = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as f:
        cut.write_bytes(f.read(600_000))  # the header and part of the 49k-token vocabulary
    with pytest.raises(ConfigError, match=r"cut\.gguf: GGUF file is truncated or corrupt"):
        load_model(str(cut))
