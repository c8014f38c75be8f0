"""Run by the vLLM venv's Python: `convert_gguf_to_hf.py GGUF OUT_DIR` writes an HF bf16 directory.

The weights are the GGUF's, dequantized by transformers (which undoes the Q/K permutation); the folder
appears under its final name only when complete (written to OUT_DIR.partial, then renamed).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def convert(gguf: Path, out_dir: Path) -> None:
    partial = out_dir.with_name(out_dir.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
    partial.rename(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: convert_gguf_to_hf.py GGUF OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
