"""Session-wide fixtures: the real embedded model (kvpilot and HF transformers on the same GGUF weights)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from kvpilot.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    """kvpilot's LLM on the embedded GGUF in float32 (the dtype in which outputs must match HF exactly)."""
    from kvpilot import LLM

    return LLM(dtype="float32", kv_cache_memory="1GiB", max_model_len=4096)


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path):
    """HF transformers' own model on the same GGUF (it dequantizes the weights itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
