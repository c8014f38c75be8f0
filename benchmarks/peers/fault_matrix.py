"""The staged fault matrix of `benchmarks/doctor_matrix.py` (issue #51, item 3): each planted fault as a server
configuration per engine plus what is staged around the server, the doctor's rule ids that name it, how a doctor
report is judged against it, and the per-engine confusion table (planted cause x first finding).

A fault's server flags are set over the engine's healthy base command (`kvpilot.doctor.verify.apply_flags`: a flag
replaces the base's value of the same flag and the `--no-` form of a boolean), so every cell differs from the
healthy server of its engine by exactly its planted cause. What is staged around the server comes from
tests/doctor/fault_staging.py, shared with the doctor's live tests: other users' traffic beside the probe, busy
loops pinned to the server's cores, a delaying TCP proxy in front of it, a doctor whose own process stalls.

Pure data and functions: nothing here starts a process (the tests import it to check every cell's command).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from peers.kvpilot_engine import kvpilot_server_spec
from peers.llamacpp import llamacpp_server_spec
from peers.servers import ServerSpec
from peers.vllm_cpu import vllm_server_spec

from kvpilot.doctor.verify import apply_flags

ENGINES = ("kvpilot", "vllm", "llamacpp")
VERIFY_ENGINES = ("kvpilot", "vllm")
"""`kvpilot doctor --serve --verify` applies fixes to `kvpilot serve` and `vllm serve` commands only."""

KVPILOT_BASE = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "1024")
"""doctor_peers.py's healthy server: float32 (720 KiB a 16-token block), 364 blocks: 5.7 requests of 1024."""
VLLM_MAX_MODEL_LEN, VLLM_KV_GIB = 1024, 2
"""vLLM's CPU build on the GGUF converted to bf16 (peers/vllm_cpu.py): 2 GiB of KV (~93k tokens), blocks of 128."""
LLAMACPP_SLOTS, LLAMACPP_CTX_PER_SLOT = 8, 1024
"""llama-server with 8 slots sharing one unified KV buffer of 8 x 1024 tokens (`--kv-unified`), `--metrics` on."""

NONE = "(none)"
"""The first-finding column of a report with nothing above LOW (exit 0): right only for a healthy server."""
ERROR = "(error)"
"""The first-finding column of a doctor run that left no JSON report (exit 2, timeout)."""
HOST_CAUSES = frozenset({"cpu-starvation", "client-overload"})
"""Causes the doctor measures on the host: on a shared machine they may truthfully lead where another fault is
planted. The "past host" count passes over them where they are not the planted cause."""


@dataclass(frozen=True)
class Cell:
    """How one engine expresses a fault: flags over its healthy base command, or why it cannot (``na``)."""

    flags: tuple[str, ...] = ()
    na: str | None = None


@dataclass(frozen=True)
class Load:
    """Other users' traffic beside the probe: closed-loop completions (tests/doctor/fault_staging.background_load)
    from ``concurrency`` clients, prompts of ``prompt_words`` common words (one token each for SmolLM2), exactly
    ``max_tokens`` out, ``pause_s`` between a client's requests; the probe starts ``warmup_s`` after it."""

    concurrency: int
    prompt_words: int
    max_tokens: int
    pause_s: float = 0.0
    warmup_s: float = 8.0


@dataclass(frozen=True)
class Fault:
    """One planted cause: each engine's cell, what is staged around the server, and the rule ids naming it
    (empty: a healthy server, where nothing above LOW is right)."""

    name: str
    planted: str
    expected: frozenset[str]
    cells: Mapping[str, Cell]
    load: Load | None = None
    spinners: bool = False
    """One busy loop per server core, pinned to the server's cores."""
    proxy_delay_ttfts: float = 0.0
    """The probe goes through a proxy delaying every chunk by this many server TTFTs (measured moments before, 4
    short requests at a time: doctor_matrix.measure_ttft_s) in each direction."""
    client_stall_ttfts: float = 0.0
    """The doctor's probe phases run beside a thread that holds its GIL this many server TTFTs once a second."""

    def cell(self, engine: str) -> Cell:
        return self.cells[engine]

    @property
    def healthy(self) -> bool:
        return not self.expected

    @property
    def outside_server(self) -> str | None:
        """What is staged outside the server's flags and its traffic (no server flag can fix it), or None."""
        if self.spinners:
            return "other processes on the server's cores"
        if self.proxy_delay_ttfts:
            return "a slow network hop in front of the server"
        if self.client_stall_ttfts:
            return "a slow client"
        return None

    @property
    def verifiable(self) -> bool:
        """Whether `kvpilot doctor --serve CMD --verify` can restage it: the fault is in the server's flags (and
        its background traffic, sent to the command's fixed port)."""
        return not self.healthy and self.outside_server is None

    def staging(self) -> list[str]:
        """What is staged around the server, in words (empty: its flags alone)."""
        out = []
        if self.load is not None:
            load = self.load
            out.append(f"background load: {load.concurrency} closed-loop clients, {load.prompt_words}-word prompts, "
                       f"{load.max_tokens} tokens out" + (f", {load.pause_s:g} s apart" if load.pause_s else "")
                       + f", from {load.warmup_s:g} s before the probe")
        if self.spinners:
            out.append("one busy loop per server core, pinned to the server's cores")
        if self.proxy_delay_ttfts:
            out.append(f"probe through a TCP proxy delaying each chunk {self.proxy_delay_ttfts:g} server TTFTs each way")
        if self.client_stall_ttfts:
            out.append(f"the doctor's probe shares its GIL with a thread holding it {self.client_stall_ttfts:g} server "
                       "TTFTs once a second")
        return out


def _same(*flags: str) -> dict[str, Cell]:
    """kvpilot and vLLM take the same flag names."""
    return {"kvpilot": Cell(flags), "vllm": Cell(flags)}


NO_SWITCH = "batches continuously; it has no flag that turns continuous batching off"
BASE = {engine: Cell() for engine in ENGINES}

FAULTS: tuple[Fault, ...] = (
    Fault("healthy", "nothing: the engine's base configuration, the probe's own traffic", frozenset(), BASE),
    Fault("too-few-seqs", "two sequences at a time under the probe's 8 in flight", frozenset({"queueing"}),
          {**_same("--max-num-seqs", "2"),
           "llamacpp": Cell(("--parallel", "2", "--ctx-size", str(2 * LLAMACPP_CTX_PER_SLOT)))}),
    Fault("one-slot", "one request at a time (one slot)", frozenset({"queueing", "static-batching"}),
          {**_same("--max-num-seqs", "1"), "llamacpp": Cell(("--parallel", "1", "--ctx-size",
                                                             str(LLAMACPP_CTX_PER_SLOT)))}),
    Fault("no-cont-batching", "slots filled only when the whole batch has finished (static batching)",
          frozenset({"static-batching", "queueing"}),
          {"kvpilot": Cell(na=NO_SWITCH), "vllm": Cell(na=NO_SWITCH), "llamacpp": Cell(("--no-cont-batching",))}),
    # The pool holds >= 4 requests of max_model_len (kv-pool-too-small stays quiet) but not the traffic: 6 clients
    # of 208 tokens need ~1,250 tokens, the pool ~1,100 (kvpilot 68 blocks of 16, vLLM 9 usable blocks of 128,
    # llama.cpp one unified buffer of 1,024), before the probe's own. Short outputs: 8 clients of 48 tokens out
    # on a busy 2-core box kept the baseline's lone request past the probe's 30 s read timeout (exit 2).
    Fault("tiny-kv-pool", "a KV pool smaller than the traffic in flight",
          frozenset({"kv-cache-pressure", "kv-pool-too-small", "max-num-seqs-over-kv"}),
          {"kvpilot": Cell(("--kv-cache-memory", "48MiB", "--max-model-len", "256")),
           "vllm": Cell(("--max-model-len", "256", "--num-gpu-blocks-override", "10")),
           "llamacpp": Cell(("--ctx-size", "1024", "--kv-unified-per-slot", "256"))},
          load=Load(concurrency=6, prompt_words=200, max_tokens=8)),
    # The pool holds about one request of max_model_len: kvpilot 34 blocks of 16 for 512; vLLM 9 usable blocks of
    # 128 for 1,024 (it refuses to start below one); llama.cpp 4 slots of up to 1,024 sharing 1,024.
    Fault("max-len-over-pool", "max_model_len about as large as the whole KV pool", frozenset({"kv-pool-too-small"}),
          {"kvpilot": Cell(("--kv-cache-memory", "24MiB", "--max-model-len", "512")),
           "vllm": Cell(("--max-model-len", "1024", "--num-gpu-blocks-override", "10")),
           "llamacpp": Cell(("--parallel", "4", "--ctx-size", "1024", "--kv-unified-per-slot", "1024"))}),
    Fault("prefix-caching-off", "prefix caching off under the probe's shared-prefix traffic",
          frozenset({"prefix-cache-miss", "prefix-caching-off"}),
          {**_same("--no-enable-prefix-caching"), "llamacpp": Cell(("--no-cache-prompt",))}),
    # A token budget that takes a whole 2,000-token prompt in one step, and another user's long prompts arriving
    # back to back: the probe's short requests (and decodes) wait for those steps.
    Fault("long-prompts", "unchunked long prompts (another user's) starving short requests",
          frozenset({"long-short-mixing", "prefill-interrupts-decode"}),
          {"kvpilot": Cell(("--max-model-len", "4096", "--kv-cache-memory", "1GiB", "--max-num-batched-tokens", "4096")),
           "vllm": Cell(("--max-model-len", "4096", "--max-num-batched-tokens", "4096")),
           "llamacpp": Cell(("--ctx-size", str(LLAMACPP_SLOTS * 4096), "--kv-unified-per-slot", "4096",
                             "--batch-size", "4096", "--ubatch-size", "4096"))},
          load=Load(concurrency=1, prompt_words=2000, max_tokens=1, pause_s=0.5)),
    Fault("cpu-starvation", "other processes spinning on the server's cores", frozenset({"cpu-starvation"}), BASE,
          spinners=True),
    Fault("slow-network", "a network hop that delays every chunk", frozenset({"network-overhead"}), BASE,
          proxy_delay_ttfts=2.0),
    Fault("slow-client", "a load generator whose event loop stalls", frozenset({"client-overload"}), BASE,
          client_stall_ttfts=2.0),
    # A sane cap (8 at a time) and more traffic than it serves: 12 other clients keep 4 waiting before the probe's.
    Fault("overloaded-queue", "more traffic than the server's batch serves", frozenset({"queueing"}),
          {**_same("--max-num-seqs", "8"), "llamacpp": Cell()},
          load=Load(concurrency=12, prompt_words=32, max_tokens=16)),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
SMOKE_FAULTS = ("one-slot", "max-len-over-pool")
"""`--smoke`: two configuration faults on kvpilot that a probe of 2-second phases names (test_live_host.py)."""


def fault(name: str) -> Fault:
    return next(f for f in FAULTS if f.name == name)


# ---- server commands -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineSetup:
    """Where the engines' files are and which cores the server gets (``server_cpus`` None: unpinned)."""

    cache_dir: Path
    gguf: Path
    threads: int
    server_cpus: tuple[int, ...] | None = None


def base_spec(engine: str, setup: EngineSetup, port: int) -> ServerSpec:
    """The engine's healthy server (peers/ builds each engine's command)."""
    if engine == "kvpilot":
        return kvpilot_server_spec(port, setup.threads, list(KVPILOT_BASE))
    if engine == "vllm":
        return vllm_server_spec(setup.cache_dir, setup.gguf, port, setup.threads, VLLM_MAX_MODEL_LEN, VLLM_KV_GIB)
    if engine == "llamacpp":
        spec = llamacpp_server_spec(setup.cache_dir, setup.gguf, port, setup.threads, LLAMACPP_SLOTS,
                                    LLAMACPP_CTX_PER_SLOT, kv_unified=True)
        return replace(spec, command=[*spec.command, "--metrics"])  # the doctor reads llamacpp: metrics
    raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def server_spec(engine: str, fault: Fault, setup: EngineSetup, port: int, pin: bool = True) -> ServerSpec:
    """The fault's server on ``engine``: its cell's flags over the base command, pinned to the server's cores
    with taskset when ``pin`` and the setup names them. ValueError for an n/a cell."""
    cell = fault.cell(engine)
    if cell.na is not None:
        raise ValueError(f"{fault.name} on {engine}: n/a ({cell.na})")
    spec = base_spec(engine, setup, port)
    command = apply_flags(spec.command, list(cell.flags))
    if pin and setup.server_cpus:
        command = ["taskset", "-c", ",".join(map(str, setup.server_cpus)), *command]
    return replace(spec, command=command)


def serve_command_line(spec: ServerSpec) -> str:
    """``kvpilot doctor --serve``'s command: the environment as a leading ``env NAME=VALUE ...`` (the doctor looks
    past it to see a `vllm serve`), then the command, one shell-quoted string."""
    import shlex  # noqa: PLC0415

    env = [f"{name}={value}" for name, value in spec.env.items()]
    return shlex.join(["env", *env, *spec.command] if env else spec.command)


# ---- judging ------------------------------------------------------------------------------------------------

def first_finding(doc: dict | None, passed_over: frozenset[str] = frozenset()) -> str:
    """The rule id of the report's first finding above LOW, skipping ``passed_over``; NONE when there is none,
    ERROR without a report."""
    if doc is None:
        return ERROR
    for finding in doc.get("findings") or []:
        if finding.get("severity") != "low" and finding.get("rule_id") not in passed_over:
            return str(finding["rule_id"])
    return NONE


def first_past_host(doc: dict | None, fault: Fault) -> str:
    """The first finding passing over the measured host causes that are not the planted one."""
    return first_finding(doc, HOST_CAUSES - fault.expected)


def is_right(fault: Fault, first: str) -> bool:
    """Healthy: nothing above LOW. A fault: one of the rule ids that name it."""
    return first == NONE if fault.healthy else first in fault.expected


# ---- the confusion table ------------------------------------------------------------------------------------

@dataclass
class Row:
    """One fault on one engine: the first findings of its repeats (strict and past host causes), or why it has
    none (``status``: n/a, not installable, the server did not start)."""

    fault: Fault
    firsts: list[str] = field(default_factory=list)
    past_host: list[str] = field(default_factory=list)
    status: str = ""

    def right(self) -> int:
        return sum(is_right(self.fault, first) for first in self.firsts)

    def right_past_host(self) -> int:
        return sum(is_right(self.fault, first) for first in self.past_host)

    def agreeing(self) -> int:
        """How many repeats gave the most common first finding."""
        return Counter(self.firsts).most_common(1)[0][1] if self.firsts else 0


def columns(rows: list[Row]) -> list[str]:
    """Every first finding seen, in the order the faults first produced them, NONE and ERROR last."""
    seen: list[str] = []
    for first in (first for row in rows for first in row.firsts):
        if first not in seen:
            seen.append(first)
    return [c for c in seen if c not in (NONE, ERROR)] + [c for c in (NONE, ERROR) if c in seen]


def confusion_lines(engine: str, rows: list[Row]) -> list[str]:
    """The table: one row per planted fault, one column per first finding seen (the count of repeats; `*` marks
    a right one), then right / repeats, right when unplanted host causes are passed over, and the repeats that
    agree. Rows without runs say why."""
    cols = columns(rows)
    widths = [max(len(c), 3) for c in cols]
    name_w = max(len(r.fault.name) for r in rows) if rows else 10
    corner = "planted \\ first"
    name_w = max(name_w, len(corner))
    head = f"{corner:<{name_w}}" + "".join(f" | {c:>{w}}" for c, w in zip(cols, widths))
    head += " | right | past host | agree"
    lines = [f"{engine}: planted cause x first finding above LOW (count of repeats; * = right)", head,
             "-" * len(head)]
    for row in rows:
        if not row.firsts:
            lines.append(f"{row.fault.name:<{name_w}} | {row.status}")
            continue
        counts = Counter(row.firsts)
        cells = [f"{counts[c]}{'*' if is_right(row.fault, c) else ' '}" if counts[c] else "" for c in cols]
        n = len(row.firsts)
        lines.append(f"{row.fault.name:<{name_w}}" + "".join(f" | {cell:>{w}}" for cell, w in zip(cells, widths))
                     + f" | {row.right():>2}/{n:<2} | {row.right_past_host():>4}/{n:<4} | {row.agreeing()}/{n}")
    ran = [r for r in rows if r.firsts]
    faults_right = sum(r.right() == len(r.firsts) for r in ran)
    lines.append(f"{engine}: right in every repeat on {faults_right} of {len(ran)} cells run "
                 f"({sum(r.right_past_host() == len(r.past_host) for r in ran)} passing over unplanted host causes; "
                 f"{sum(r.agreeing() == len(r.firsts) for r in ran)} with one first finding in every repeat)")
    return lines


def confusion_json(rows: list[Row]) -> dict:
    """{fault: {first finding: count}} plus the scores, for the JSON result."""
    return {"cells": {r.fault.name: dict(Counter(r.firsts)) if r.firsts else r.status for r in rows},
            "right": {r.fault.name: [r.right(), len(r.firsts)] for r in rows if r.firsts},
            "right_past_host": {r.fault.name: [r.right_past_host(), len(r.past_host)] for r in rows if r.firsts},
            "agree": {r.fault.name: [r.agreeing(), len(r.firsts)] for r in rows if r.firsts}}
