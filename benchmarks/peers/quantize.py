"""Requantized copies of the embedded GGUF for the like-for-like comparisons (q4_0, q4_k_m, iq4_xs): the type mix each
asks of llama.cpp's quantizer, where a copy lives, when it is reused, and the check that it holds that mix.

Invariant: `<cache>/models/<model>.<TYPE>.gguf` is used only when its stamp file names the current source (path,
size, mtime) and the mix's recipe; it is written under a .partial name and renamed when complete and checked,
the stamp last, so an interrupted requantization is redone, and so is one from an updated embedded model.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from peers.venvs import InstallError, PeerVenv

REQUANTIZER = Path(__file__).with_name("requantize_gguf.py")
HEAD_TENSORS = ("token_embd.weight", "output.weight")  # the embedding, also the output head when tied
QUANT_SUFFIX = re.compile(r"\.(?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class QuantMix:
    """One llama.cpp quantization type (`name`: its LLAMA_FTYPE_MOSTLY_ suffix, also the copy's file suffix) and
    what a copy made with it must hold: every matrix one of `matrix_types`, at least one of `core_types` (else
    the copy does not exercise the format at all); with `head_type`, the quantizer is asked for that type on
    the embedding / output head and they must have it (None: llama.cpp's own choice). Vectors stay F32."""

    name: str
    matrix_types: frozenset[str]
    core_types: frozenset[str]
    head_type: str | None = None

    @property
    def key(self) -> str:
        """The comparison and contender-weights name: "q4_0", "q4_k_m"."""
        return self.name.lower()

    def recipe(self) -> str:
        return f"{self.name}; head {self.head_type or 'llama.cpp default'}"


# The tied embedding / output head stays Q8_0 (as in the source): otherwise llama.cpp would pick Q6_K, and the
# copy would no longer be all Q4_0 blocks.
Q4_0_MIX = QuantMix("Q4_0", frozenset({"Q4_0"}), frozenset({"Q4_0"}), head_type="Q8_0")
# llama.cpp's own Q4_K_M: Q4_K, Q6_K for the head and some attn_v / ffn_down, Q5_K for fused QKV; a matrix
# whose rows are not whole 256-weight super-blocks falls back to Q5_0 / Q5_1 / Q8_0 (Q4_K / Q5_K / Q6_K).
Q4_K_M_MIX = QuantMix("Q4_K_M", frozenset({"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"}), frozenset({"Q4_K"}))
# llama.cpp's IQ4_XS (the 4.25-bit type many published GGUFs ship): IQ4_XS where rows are whole 256-weight super-blocks,
# IQ4_NL elsewhere, some attn_v / ffn_down raised by its rules; the head Q8_0 as in the source.
IQ4_XS_MIX = QuantMix("IQ4_XS", frozenset({"IQ4_XS", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"}),
                      frozenset({"IQ4_XS"}), head_type="Q8_0")
REQUANTIZED_MIXES = {mix.key: mix for mix in (Q4_0_MIX, Q4_K_M_MIX, IQ4_XS_MIX)}


def requantized_path(cache_dir: Path, source: Path, mix: QuantMix) -> Path:
    """`<cache>/models/<source stem without its quantization suffix>.<TYPE>.gguf`."""
    return cache_dir / "models" / f"{QUANT_SUFFIX.sub('', source.stem)}.{mix.name}.gguf"


def stamp_path(copy: Path) -> Path:
    return copy.with_name(copy.name + ".source")


def source_stamp(source: Path, mix: QuantMix) -> str:
    stat = source.stat()
    return f"{source.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n{mix.recipe()}\n"


def is_current(copy: Path, source: Path, mix: QuantMix) -> bool:
    """Whether `copy` is complete and was made from `source` as it is now, with `mix`'s recipe."""
    stamp = stamp_path(copy)
    return copy.is_file() and stamp.is_file() and stamp.read_text() == source_stamp(source, mix)


def tensor_type_problems(tensors: dict[str, tuple[str, int]], mix: QuantMix) -> list[str]:
    """What is wrong with a copy's tensors ({name: (GGML type name, number of dims)}) for `mix`; [] when it is
    as intended."""
    problems = []
    for name, (type_name, num_dims) in sorted(tensors.items()):
        if num_dims < 2:
            allowed = {"F32"}
        elif mix.head_type is not None and name in HEAD_TENSORS:
            allowed = {mix.head_type}
        else:
            allowed = mix.matrix_types
        if type_name not in allowed:
            problems.append(f"{name} is {type_name}, expected {' or '.join(sorted(allowed))}")
    if not tensors:
        problems.append("no tensors")
    elif not any(type_name in mix.core_types for type_name, _ in tensors.values()):
        problems.append(f"no {' or '.join(sorted(mix.core_types))} tensor: not a {mix.name} file")
    return problems


def type_mix(tensors: dict[str, tuple[str, int]]) -> str:
    """`Q5_0 x 120, Q4_K x 18, ...`: how many tensors have each type, most common first."""
    counts = Counter(type_name for type_name, _ in tensors.values())
    return ", ".join(f"{type_name} x {count}" for type_name, count in counts.most_common())


@dataclass(frozen=True)
class RequantizedCopy:
    """A checked copy: its file, the bytes its tensors take in it, and its type mix (type_mix)."""

    path: Path
    tensor_bytes: int
    types: str

    def describe(self) -> str:
        return f"{self.path} ({self.tensor_bytes / 2**20:,.1f} MiB of tensors: {self.types})"


def read_copy(path: Path) -> RequantizedCopy:
    reader = _reader(path)
    return RequantizedCopy(path, sum(int(t.n_bytes) for t in reader.tensors), type_mix(_tensor_types(reader)))


def read_tensor_types(gguf_file: Path) -> dict[str, tuple[str, int]]:
    return _tensor_types(_reader(gguf_file))


def _reader(gguf_file: Path):
    import gguf  # kvpilot's own dependency (its GGUF reader)

    return gguf.GGUFReader(str(gguf_file))


def _tensor_types(reader) -> dict[str, tuple[str, int]]:
    return {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}


def requantize_command(llamacpp: PeerVenv, source: Path, out: Path, mix: QuantMix, num_threads: int) -> list[str]:
    command = [str(llamacpp.python), str(REQUANTIZER), str(source), str(out), "--type", mix.name,
               "--threads", str(num_threads)]
    return command + (["--head-type", mix.head_type] if mix.head_type else [])


def ensure_requantized_copy(cache_dir: Path, source: Path, mix: QuantMix, llamacpp: PeerVenv,
                            num_threads: int) -> Path:
    """The `mix` copy of `source`, made with llama.cpp's quantizer in its venv unless a current one exists."""
    copy = requantized_path(cache_dir, source, mix)
    if is_current(copy, source, mix):
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    partial = copy.with_name(copy.name + ".partial")
    partial.unlink(missing_ok=True)
    stamp_path(copy).unlink(missing_ok=True)
    llamacpp.run(requantize_command(llamacpp, source, partial, mix, num_threads),
                 f"requantize the embedded GGUF to {mix.name}")
    problems = tensor_type_problems(read_tensor_types(partial), mix)
    if problems:
        raise InstallError(f"the {mix.name} copy {partial} is not as intended ({'; '.join(problems[:5])}); "
                           f"see {llamacpp.log_path}")
    partial.replace(copy)
    stamp_path(copy).write_text(source_stamp(source, mix))
    return copy
