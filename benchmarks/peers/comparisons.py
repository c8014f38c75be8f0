"""The comparisons `peers_cpu.py` runs: each is one kvpilot configuration against peers on the same weights.

- default: kvpilot's defaults (the embedded Q4_1 GGUF, packed) against the engines of --engines as they have
  always been run (llama.cpp on the same Q4_1 file with --parallel of the largest workload, vLLM on the GGUF
  dequantized to bf16). Mostly a comparison of weight formats at c16/c64, kept for continuity.
- bf16: kvpilot `--quantization none --dtype bfloat16` (the GGUF dequantized at load) against vLLM on the same
  GGUF dequantized to bf16 by transformers: dense bf16 weights on both sides.
- q4_0, q4_k_m, iq4_xs: a requantized copy of the embedded GGUF (peers/quantize.py; Q4_0 is one of llama.cpp's
  repacked x86 fast formats, Q4_K_M the mix most llama.cpp users hold, IQ4_XS the 4.25-bit type many published
  GGUFs ship) served by kvpilot with its defaults and by llama.cpp's llama-server started anew for each workload
  with `--parallel` equal to its concurrency and one KV buffer per slot (its own default then; peers_cpu.py's
  --llama-kv-unified gives it one shared buffer, `--kv-unified`).

Invariant: every contender's label is unique across comparisons, so a label names one configuration in the
rows, and run order within a comparison alternates kvpilot with each peer (kvpilot first and last).
"""

from __future__ import annotations

from dataclasses import dataclass

from peers.quantize import REQUANTIZED_MIXES

COMPARISON_NAMES = ("default", "bf16", *REQUANTIZED_MIXES)
# what a plain `peers_cpu.py` runs: iq4_xs only when asked (--comparisons iq4_xs)
DEFAULT_COMPARISONS = ("default", "bf16", "q4_0", "q4_k_m")


@dataclass(frozen=True)
class Contender:
    """One engine configuration: `label` names its rows, `engine` is what starts it (kvpilot, llamacpp,
    llamacpp-py, vllm), `weights` which copy of the model it serves: "embedded" (the GGUF as shipped; vLLM
    always gets its bf16 HF conversion), "bf16" (kvpilot dequantizes at load) or a key of REQUANTIZED_MIXES
    ("q4_0", "q4_k_m": that requantized copy).
    `slots_per_workload`: a llama-server started per workload with --parallel = that workload's concurrency."""

    label: str
    engine: str
    weights: str = "embedded"
    slots_per_workload: bool = False


@dataclass(frozen=True)
class Comparison:
    """kvpilot's contender (`ours`, None when --engines leaves kvpilot out) against `peers`."""

    name: str
    ours: Contender | None
    peers: tuple[Contender, ...]

    def contenders(self) -> list[Contender]:
        return [c for c in (self.ours, *self.peers) if c is not None]

    def sequence(self, passes: int) -> list[Contender]:
        """Run order: ours, peer1, ours, peer2, ours, ... repeated `passes` times, so each peer pass has a
        kvpilot pass on either side (drift of the machine shows as a change between kvpilot passes)."""
        if self.ours is None:
            return [peer for _ in range(passes) for peer in self.peers]
        if not self.peers:
            return [self.ours] * passes
        order = [self.ours]
        for _ in range(passes):
            for peer in self.peers:
                order += [peer, self.ours]
        return order

    def engines(self) -> set[str]:
        """The peer engines this comparison needs installed."""
        return {peer.engine for peer in self.peers}

    def without(self, engines: set[str]) -> Comparison:
        """The comparison minus the peers whose engine is in `engines` (could not be installed)."""
        return Comparison(self.name, self.ours, tuple(p for p in self.peers if p.engine not in engines))


def build_comparisons(names: list[str], engines: list[str]) -> list[Comparison]:
    """The named comparisons, in the order given; `engines` (--engines) shapes only the default one."""
    comparisons = []
    for name in dict.fromkeys(names):
        if name == "default":
            ours = Contender("kvpilot", "kvpilot") if "kvpilot" in engines else None
            peers = tuple(Contender(engine, engine) for engine in engines if engine != "kvpilot")
            comparisons.append(Comparison("default", ours, peers))
        elif name == "bf16":
            comparisons.append(Comparison("bf16", Contender("kvpilot-bf16", "kvpilot", "bf16"),
                                          (Contender("vllm-bf16", "vllm"),)))
        elif name in REQUANTIZED_MIXES:
            comparisons.append(Comparison(name, Contender(f"kvpilot-{name}", "kvpilot", name),
                                          (Contender(f"llamacpp-{name}", "llamacpp", name, slots_per_workload=True),)))
        else:
            raise ValueError(f"unknown comparison {name!r}; choose from {','.join(COMPARISON_NAMES)}")
    return comparisons

