"""Issue 14: a model whose context does not fit the KV cache (a dummy `qwen3-0.6b` on the 2 GiB CPU cache) runs
with the largest max_model_len that fits when the user named none, saying so; a named one that does not fit is
refused with the largest value that would."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvpilot.engine.config import EngineConfigError
from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.llm import LLM
from kvpilot.sampling_params import SamplingParams
from tests.server.tiny_server import write_tiny_config

# 2 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 3,072 bytes a token: 4 MiB hold 85 blocks of 16
FITTING_LEN = 85 * 16


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


def test_unnamed_max_model_len_shrinks_to_what_fits(tiny_config: Path, caplog: pytest.LogCaptureFixture) -> None:
    context = get_hf_config("smollm2-135m")["max_position_embeddings"]
    assert context > FITTING_LEN
    with caplog.at_level(logging.INFO, logger="kvpilot"):
        llm = LLM(str(tiny_config), load_format="dummy", dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.scheduler.config.max_model_len == FITTING_LEN
    notice = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert notice and f"using max_model_len {FITTING_LEN}" in notice[0] and "--kv-cache-memory" in notice[0]
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3  # the engine serves


def test_named_max_model_len_that_does_not_fit_names_the_largest(tiny_config: Path) -> None:
    with pytest.raises(EngineConfigError, match=f"the largest max_model_len that fits is {FITTING_LEN}"):
        LLM(str(tiny_config), load_format="dummy", dtype="float32", kv_cache_memory="4MiB",
            max_model_len=FITTING_LEN + 16)


def test_reused_weights_refuse_a_longer_max_model_len_than_their_rotary_tables(tiny_config: Path) -> None:
    """LLM(loaded=...) shares weights built for one max_model_len: a longer one would index past the rotary
    tables mid-request (an IndexError in the step); it is refused at start, naming what to do."""
    base = LLM(str(tiny_config), load_format="dummy", dtype="float32", kv_cache_memory="4MiB", max_model_len=256)
    with pytest.raises(EngineConfigError, match=r"max_model_len 512 .* 256 positions .* max_model_len >= 512"):
        LLM(loaded=base.loaded, kv_cache_memory="4MiB", max_model_len=512)
    shorter = LLM(loaded=base.loaded, kv_cache_memory="4MiB", max_model_len=128)
    assert shorter.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_an_interleaved_models_context_shrinks_to_what_its_kv_groups_fit(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Gemma 3's layers in 3 KV groups (one full, two sliding over 8 tokens): 12 blocks of 16 are 192 token slots,
    but a request of L tokens holds cdiv(L, 16) full-layer blocks plus 3 in each sliding group, so 96 tokens fit.
    The default was the slot count (192) and the engine then refused to start."""
    from tests.model.test_gemma import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["gemma3"]))
    with caplog.at_level(logging.INFO, logger="kvpilot"):
        llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", kv_cache_memory="96KiB",
                  max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.engine.scheduler.config.max_model_len == 96
    lines = [r.getMessage() for r in caplog.records]
    assert any("192 token slots over 3 KV groups); using max_model_len 96" in line for line in lines)
    assert any(line.startswith("KV cache: 12 blocks x 16 = 192 token slots over 3 KV groups") for line in lines)
    out = llm.generate([[5] * 80], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 16
