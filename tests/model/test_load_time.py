"""What a model load costs: the GGUF header read through plain views, no compiler stack imported.

Every `kvpilot serve`, `LLM()` and test fixture pays for a load; on the 2-core box these kept a warm
`LLM()` at 7-8 s (3 s after them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from kvpilot.fit.gguf_metadata import open_gguf

pytestmark = pytest.mark.slow


def test_the_plain_view_reader_reads_what_the_gguf_reader_reads(gguf_path: Path) -> None:
    ours, theirs = open_gguf(gguf_path), GGUFReader(str(gguf_path))
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.architecture", "llama.block_count"):
        assert ours.fields[name].contents() == theirs.fields[name].contents(), name
    assert [(t.name, t.tensor_type, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.n_bytes) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(mine.data, reference.data), mine.name


_LOAD_AND_LIST_IMPORTS = """
import sys
from kvpilot import LLM, SamplingParams
llm = LLM(max_model_len=256)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
print(sorted(m for m in ("sympy", "torch._dynamo", "torch.fx.experimental.symbolic_shapes") if m in sys.modules))
"""


def test_loading_and_running_the_embedded_model_imports_no_compiler_stack() -> None:
    """torch._dynamo (2-3 s) came in through nn.Embedding's random init on the meta device, sympy (0.6 s)
    through Module.to_empty; neither is needed to run a model on the CPU."""
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_LIST_IMPORTS], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
