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
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kvpilot.fit.gguf_metadata import open_gguf

pytestmark = pytest.mark.slow


def _same_fields(ours: GGUFReader, theirs: GGUFReader) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
        assert ours.fields[name].types == field.types, name


def test_the_plain_view_reader_reads_what_the_gguf_reader_reads(gguf_path: Path) -> None:
    ours, theirs = open_gguf(gguf_path), GGUFReader(str(gguf_path))
    assert type(ours.data) is np.ndarray and not ours.data.flags.writeable
    _same_fields(ours, theirs)  # the vocabulary and merges (arrays of strings), token types (of int32)
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.n_bytes, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.n_bytes, t.data_offset) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(mine.data, reference.data), mine.name


def _empty_the_array(path: Path, key: str, item_size: int) -> None:
    """Rewrites a one-element array field as an empty one (its count 0, its element cut out)."""
    raw = path.read_bytes()
    count_at = raw.index(key.encode()) + len(key) + 8  # after the key: value type, element type (u32 each)
    assert int.from_bytes(raw[count_at:count_at + 8], "little") == 1
    path.write_bytes(raw[:count_at] + (0).to_bytes(8, "little") + raw[count_at + 8 + item_size:])


def test_arrays_of_every_kind_read_as_the_gguf_reader_reads_them(tmp_path: Path) -> None:
    """Arrays read in bulk (numbers as one view, strings as memoryview slices): empty ones, non-ASCII
    strings, every numeric width, booleans, and nested arrays (left to the stock element-wise walk)."""
    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("t.strings", ["", "a", "héllo ▁wörld", "x" * 300])
    writer.add_array("t.empty", [5])  # emptied below: GGUFWriter leaves empty arrays out
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_uint32("t.after", 7)  # read at the offset the arrays before it end at
    writer.add_string("t.tail", "end")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _empty_the_array(path, "t.empty", item_size=4)
    ours, theirs = open_gguf(path), GGUFReader(str(path))
    _same_fields(ours, theirs)
    assert ours.fields["t.strings"].contents() == ["", "a", "héllo ▁wörld", "x" * 300]
    assert ours.fields["t.empty"].contents() == [] and ours.fields["t.empty"].types == [GGUFValueType.ARRAY]
    assert ours.fields["t.after"].contents() == 7 and ours.fields["t.tail"].contents() == "end"


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


def test_a_load_reads_the_gguf_header_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype auto asks whether the int8 path takes the file, then loads it: one header read between them (a
    49k-token vocabulary takes ~0.2 s to parse), and none kept after the load."""
    from kvpilot.fit import gguf_metadata
    from kvpilot.model.loader import load_model

    opened = []

    def counting_open(path):
        opened.append(Path(path).name)
        return open_gguf(path)

    monkeypatch.setattr(gguf_metadata, "open_gguf", counting_open)
    load_model(max_model_len=64)
    assert len(opened) == 1
    load_model(max_model_len=64)  # a new load, a new read
    assert len(opened) == 2


def test_the_embedding_table_comes_from_the_kernel_with_the_gguf_package_s_values(gguf_path: Path) -> None:
    """A packed-format matrix read dense (the embedding table) goes through the loaded quant kernel, ~4x faster
    than the gguf package's numpy, to the same float32 values."""
    from gguf.quants import dequantize

    from kvpilot.model import gguf_weights
    from kvpilot.model.quant.kernel import get_quant_kernel, loaded_quant_kernel

    if get_quant_kernel() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    assert loaded_quant_kernel() is not None
    table = next(t for t in open_gguf(gguf_path).tensors if t.name == "token_embd.weight")
    assert np.array_equal(gguf_weights._dequantize(table, gguf_path), dequantize(table.data, table.tensor_type))
