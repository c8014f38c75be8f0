"""The Q4_0 copy of the embedded GGUF for the q4_0 comparison: where it lives, when it is reused, and the
check that it holds what both engines' fast paths take.

Invariant: `<cache>/models/<model>.Q4_0.gguf` is used only when its stamp file names the current source (path,
size, mtime); it is written under a .partial name and renamed when complete and checked, the stamp last, so
an interrupted requantization is redone and an updated embedded model is requantized again.
"""

from __future__ import annotations

import re
from pathlib import Path

from peers.venvs import InstallError, PeerVenv

REQUANTIZER = Path(__file__).with_name("requantize_gguf.py")
# The tied embedding / output head stays Q8_0 (as in the source); every other matrix becomes Q4_0.
HEAD_TENSORS = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
QUANT_SUFFIX = re.compile(r"\.(?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def q4_0_path(cache_dir: Path, source: Path) -> Path:
    """`<cache>/models/<source stem without its quantization suffix>.Q4_0.gguf`."""
    return cache_dir / "models" / f"{QUANT_SUFFIX.sub('', source.stem)}.Q4_0.gguf"


def stamp_path(copy: Path) -> Path:
    return copy.with_name(copy.name + ".source")


def source_stamp(source: Path) -> str:
    stat = source.stat()
    return f"{source.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n"


def is_current(copy: Path, source: Path) -> bool:
    """Whether `copy` is complete and was made from `source` as it is now."""
    stamp = stamp_path(copy)
    return copy.is_file() and stamp.is_file() and stamp.read_text() == source_stamp(source)


def tensor_type_problems(tensors: dict[str, tuple[str, int]]) -> list[str]:
    """What is wrong with a Q4_0 copy's tensors ({name: (GGML type name, number of dims)}): matrices must be
    Q4_0 except the embedding / output head (Q8_0); vectors (norms) F32. [] when it is as intended."""
    problems = []
    for name, (type_name, num_dims) in sorted(tensors.items()):
        expected = "F32" if num_dims < 2 else HEAD_TENSORS.get(name, "Q4_0")
        if type_name != expected:
            problems.append(f"{name} is {type_name}, expected {expected}")
    if not tensors:
        problems.append("no tensors")
    return problems


def read_tensor_types(gguf_file: Path) -> dict[str, tuple[str, int]]:
    import gguf  # kvpilot's own dependency (its GGUF reader)

    reader = gguf.GGUFReader(str(gguf_file))
    return {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}


def ensure_q4_0_copy(cache_dir: Path, source: Path, llamacpp: PeerVenv, num_threads: int) -> Path:
    """The Q4_0 copy of `source`, made with llama.cpp's quantizer in its venv unless a current one exists."""
    copy = q4_0_path(cache_dir, source)
    if is_current(copy, source):
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    partial = copy.with_name(copy.name + ".partial")
    partial.unlink(missing_ok=True)
    stamp_path(copy).unlink(missing_ok=True)
    llamacpp.run([str(llamacpp.python), str(REQUANTIZER), str(source), str(partial), str(num_threads)],
                 "requantize the embedded GGUF to Q4_0")
    problems = tensor_type_problems(read_tensor_types(partial))
    if problems:
        raise InstallError(f"the Q4_0 copy {partial} is not as intended ({'; '.join(problems[:5])}); "
                           f"see {llamacpp.log_path}")
    partial.replace(copy)
    stamp_path(copy).write_text(source_stamp(source))
    return copy
