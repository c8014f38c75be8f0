"""One staged input per rule, each shaped like the deployment fault that causes it (and a healthy one).

Every scenario returns the arguments of ``load_inputs``: (result paths, metrics paths, model, gpu).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.records import RequestRecord
from kvpilot.bench.replicas import ReplicaPlan, ReplicaSample, ReplicaValues
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write

Scenario = tuple[list[str], list[str], str | None, str | None]
FIXTURES = Path(__file__).parent / "fixtures"


def healthy(tmp: Path) -> Scenario:
    """A well-configured server at concurrency 4: short queue, small KV use, steady decode."""
    rng = random.Random(1)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prompt=int(jitter(rng, 256)), prefill=jitter(rng, 40),
                                                itl=[jitter(rng, 12, 0.2) for _ in range(31)]))
    metrics = samples(2, running=4, waiting=0, kv=0.3)
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=metrics)])], [], None, None


def queueing(tmp: Path) -> Scenario:
    """`--max-num-seqs 1` under 8 concurrent clients: each request waits for the seven before it."""
    rng = random.Random(2)
    service = 0.04 + 31 * 0.012
    recs = closed_loop(40, 8, lambda i, t: req(i, t, queue=jitter(rng, 7 * service * 1000), prefill=40.0))
    return [write(tmp / "r.json", [run("concurrency=8", recs, concurrency=8,
                                       metrics=samples(5, running=1, waiting=7, kv=0.05))])], [], None, None


def tokenization(tmp: Path) -> Scenario:
    """An artificially slow (pure-Python) tokenizer: 0.2 ms per prompt token."""
    rng = random.Random(3)

    def make(i: int, t: float) -> RequestRecord:
        prompt = rng.randint(500, 4000)
        return req(i, t, prompt=prompt, tokenize=0.2 * prompt, prefill=30 + 0.005 * prompt)
    recs = closed_loop(30, 2, make)
    return [write(tmp / "r.json", [run("concurrency=2", recs, concurrency=2,
                                       metrics=samples(3, running=2, waiting=0, kv=0.2))])], [], None, None


def kv_pressure(tmp: Path) -> Scenario:
    """A KV pool far too small: usage pinned at 99%, requests preempted and waiting."""
    rng = random.Random(4)
    recs = closed_loop(40, 16, lambda i, t: req(i, t, queue=jitter(rng, 90), prefill=jitter(rng, 60),
                                                 preempt=1 if i % 3 == 0 else 0))
    return [write(tmp / "r.json", [run("concurrency=16", recs, concurrency=16,
                                       metrics=samples(3, running=5, waiting=11, kv=0.99, preemptions=14))])], \
        [], None, None


def prefill_bound(tmp: Path) -> Scenario:
    """Prompts from 256 to 8k tokens on a slow prefill path: 0.25 ms per prompt token, decode normal."""
    rng = random.Random(5)

    def make(i: int, t: float) -> RequestRecord:
        prompt = rng.choice([256, 512, 1024, 2048, 4096, 8192])
        return req(i, t, prompt=prompt, prefill=jitter(rng, 0.25 * prompt, 0.05), num_out=16)
    recs = closed_loop(36, 1, make)
    return [write(tmp / "r.json", [run("concurrency=1", recs, concurrency=1,
                                       metrics=samples(20, running=1, waiting=0, kv=0.2))])], [], None, None


def decode_bound(tmp: Path) -> Scenario:
    """Llama-3.1-8B on an H100 (roofline TPOT ~4.5 ms) decoding at 30 ms per token at batch 1."""
    rng = random.Random(6)
    recs = closed_loop(20, 1, lambda i, t: req(i, t, prompt=512, prefill=jitter(rng, 25),
                                                itl=[jitter(rng, 30, 0.05) for _ in range(63)]))
    return [write(tmp / "r.json", [run("synchronous", recs, concurrency=1,
                                       metrics=samples(20, running=1, waiting=0, kv=0.02))])], \
        [], "llama-3.1-8b", "h100-sxm"


def static_batching(tmp: Path) -> Scenario:
    """A server without continuous batching or metrics (client-only timings): at 8 clients requests
    simply take turns, so throughput stays flat and TTFT absorbs the wait."""
    rng = random.Random(7)
    service_ms = 40 + 31 * 12
    one = closed_loop(20, 1, lambda i, t: req(i, t, server=False, itl=jitter(rng, 12, 0.02)))
    eight = closed_loop(40, 8, lambda i, t: req(i, t, server=False, prefill=40 + jitter(rng, 7 * service_ms, 0.02),
                                                 itl=jitter(rng, 12, 0.02)))
    return [write(tmp / "one.json", [run("concurrency=1", one, concurrency=1)]),
            write(tmp / "eight.json", [run("concurrency=8", eight, concurrency=8)])], [], None, None


def _decoding_shorts(rng: random.Random, stall_windows: list[tuple[float, float]]) -> list[RequestRecord]:
    """Seven short requests streaming 15 ms gaps from t=0, stalled during each window."""
    recs = []
    for i in range(7):
        sent = 0.01 * i
        t = sent + 0.042
        gaps = []
        for _ in range(199):
            gap = jitter(rng, 15, 0.1)
            for a, b in stall_windows:
                if t < b <= t + gap / 1000 or a <= t < b:
                    gap = (b - t) * 1000 + 5
            gaps.append(gap)
            t += gap / 1000
        recs.append(req(i, sent, prompt=128, itl=gaps))
    return recs


def prefill_interrupts_decode(tmp: Path) -> Scenario:
    """A huge token budget: two 8k-token prompts arrive and prefill in one 600 ms step each, stalling
    everyone's decoding."""
    rng = random.Random(8)
    windows = [(1.0, 1.6), (2.2, 2.8)]
    recs = _decoding_shorts(rng, windows)
    recs += [req(7 + k, a, prompt=8192, prefill=(b - a) * 1000 - 3.5, itl=15.0, num_out=20)
             for k, (a, b) in enumerate(windows)]
    return [write(tmp / "r.json", [run("concurrency=9", recs, concurrency=9,
                                       metrics=samples(3, running=9, waiting=0, kv=0.4))])], [], None, None


def long_short(tmp: Path) -> Scenario:
    """Open loop, 5% 8k-token prompts: short requests arriving during a long prefill wait for it."""
    rng = random.Random(9)
    recs, longs = [], [(k * 1.0 + 0.3, k * 1.0 + 1.1) for k in range(3)]
    for i in range(60):
        sent = i * 0.05
        for a, b in longs:
            if a <= sent < b:
                wait = (b - sent) * 1000
                break
        else:
            wait = 0.0
        recs.append(req(i, sent, prompt=128, prefill=jitter(rng, 30) + wait, num_out=1, group="short"))
    recs += [req(60 + k, a, prompt=8192, prefill=(b - a) * 1000 - 3.5, num_out=1, group="long")
             for k, (a, b) in enumerate(longs)]
    return [write(tmp / "r.json", [run("rate=20/s", recs, concurrency=None, request_rate=20.0,
                                       metrics=samples(3, running=3, waiting=0, kv=0.3))])], [], None, None


def prefix_cache_miss(tmp: Path) -> Scenario:
    """Shared-prefix traffic (4 prefixes of 512 of 640 tokens) with prefix caching off: 0 cached tokens."""
    rng = random.Random(10)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prompt=640, prefill=jitter(rng, 60), group=f"prefix-{i % 4}"))
    dataset = DatasetConfig(kind="shared-prefix", input_len=640, prefix_len=512, num_prefixes=4, num_suffixes=10)
    metrics = samples(3, running=4, waiting=0, kv=0.3, prefix_queries=40 * 640, prefix_hits=0)
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=metrics)], dataset=dataset)], [], None, None


def network_overhead(tmp: Path) -> Scenario:
    """A delaying proxy in front of the server: 150 ms between client and server."""
    rng = random.Random(11)
    recs = closed_loop(30, 4, lambda i, t: req(i, t, net=jitter(rng, 150), prefill=jitter(rng, 40)))
    metrics = samples(3, running=4, waiting=0, kv=0.3)
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=metrics)])], [], None, None


def client_overload(tmp: Path) -> Scenario:
    """The load generator's event loop stalls 40 ms at a time (an overloaded client process)."""
    rng = random.Random(12)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prefill=jitter(rng, 40)))
    lag = [(k * 0.01, 40.0 if k % 20 == 0 else 0.5) for k in range(400)]
    return [write(tmp / "r.json", [run("concurrency=4", recs, loop_lag=lag,
                                       metrics=samples(3, running=4, waiting=0, kv=0.3))])], [], None, None


def memory_spillover(tmp: Path) -> Scenario:
    """An 8B model on an H100 whose KV spills to CPU swap space (vLLM V0 names): 60 ms per token."""
    rng = random.Random(13)
    recs = closed_loop(20, 1, lambda i, t: req(i, t, server=False, prompt=512, prefill=jitter(rng, 40),
                                                itl=[jitter(rng, 60, 0.05) for _ in range(63)]))
    return ([write(tmp / "r.json", [run("synchronous", recs, concurrency=1)])],
            [str(FIXTURES / "vllm_v0_swapping.txt")], "llama-3.1-8b", "h100-sxm")


def slo_floor(tmp: Path) -> Scenario:
    """A bench run with a 300 ms TTFT SLO on uniform 512-token prompts that take 700 ms to prefill alone."""
    rng = random.Random(14)
    recs = closed_loop(20, 1, lambda i, t: req(i, t, prompt=512, prefill=jitter(rng, 700, 0.03), num_out=16))
    return [write(tmp / "r.json", [run("concurrency=1", recs, concurrency=1,
                                       metrics=samples(20, running=1, waiting=0, kv=0.2))],
                  slos={"ttft": 300.0})], [], None, None


GATEWAY = ReplicaPlan(labelled_url="http://gw:8000/metrics/replicas")


def degraded_run(tmp: Path) -> Scenario:
    """Four clients; 1.5 s in, other processes take the cores and every step takes 10x longer for the rest of
    the run: no stage stands out, but most of the run is far below the speed its first windows showed."""
    rng = random.Random(12)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prefill=jitter(rng, 40 if t < 1.5 else 400),
                                                itl=[jitter(rng, 12 if t < 1.5 else 120, 0.2) for _ in range(31)]))
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=samples(24, running=4, waiting=0, kv=0.1))])], \
        [], None, None


def replica_samples(t_end: float, counters: dict[str, dict[str, float]],
                    gauges: dict[str, dict[str, float]]) -> list[ReplicaSample]:
    """Per-replica scrapes (lane "default"): counters 0 before and at ``counters`` after, ``gauges`` during."""
    def at(t: float, phase: str, values: dict[str, dict[str, float]]) -> ReplicaSample:
        return ReplicaSample(t, phase, {rid: ReplicaValues("default", v) for rid, v in values.items()})
    zeros = {rid: dict.fromkeys(c, 0.0) for rid, c in counters.items()}
    return [at(0.0, "before", zeros), at(t_end / 2, "during", gauges), at(t_end, "after", counters)]


def prefix_blind_routing(tmp: Path) -> Scenario:
    """Two replicas behind a round-robin balancer; 8 prefixes of 512 of 640 tokens, 4 requests each: every
    group reaches both replicas, each recomputes every prefix and, holding all of them twice over, evicts some
    (hit rate 25% where 60% is offered)."""
    rng = random.Random(15)
    recs = closed_loop(32, 4, lambda i, t: req(i, t, prompt=640, prefill=jitter(rng, 60), group=f"prefix-{i % 8}",
                                                replica=f"r{(i // 8) % 2}"))
    dataset = DatasetConfig(kind="shared-prefix", input_len=640, prefix_len=512, num_prefixes=8, num_suffixes=4)
    per_replica = {"prefix_queries": 16 * 640.0, "prefix_hits": 2560.0, "requests_ok": 16.0}
    reps = replica_samples(6, {"r0": per_replica, "r1": per_replica},
                           {"r0": {"running": 2, "waiting": 0}, "r1": {"running": 2, "waiting": 0}})
    metrics = samples(6, running=4, waiting=0, kv=0.3, prefix_queries=32 * 640, prefix_hits=2 * 2560)
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=metrics, replica_plan=GATEWAY,
                                       replica_samples=reps, prefix_share=0.8)], dataset=dataset)], [], None, None


def replica_imbalance(tmp: Path) -> Scenario:
    """Two replicas of one lane; sticky sessions put 32 of 40 requests on r0, where requests wait."""
    rng = random.Random(16)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, queue=jitter(rng, 8), prefill=jitter(rng, 40),
                                                replica="r1" if i % 5 == 4 else "r0"))
    reps = replica_samples(6, {"r0": {"requests_ok": 32.0}, "r1": {"requests_ok": 8.0}},
                           {"r0": {"running": 3, "waiting": 2}, "r1": {"running": 1, "waiting": 0}})
    metrics = samples(6, running=4, waiting=0.5, kv=0.3)
    return [write(tmp / "r.json", [run("concurrency=4", recs, metrics=metrics, replica_plan=GATEWAY,
                                       replica_samples=reps)])], [], None, None


def speculation_costs(tmp: Path) -> Scenario:
    """N-gram speculation on a busy server: 16 clients, each verification of 4 drafts accepting 0.6 of them, so
    the verify rows cost more decode time than the accepted drafts save."""
    rng = random.Random(21)

    def make(i: int, t: float) -> RequestRecord:
        rec = req(i, t, itl=jitter(rng, 20, 0.05))
        assert rec.server is not None
        return dataclasses.replace(rec, server=dataclasses.replace(
            rec.server, num_drafts=10, num_draft_tokens=40, num_accepted_tokens=6))

    recs = closed_loop(48, 16, make)
    return [write(tmp / "r.json", [run("concurrency=16", recs, concurrency=16)])], [], None, None


def prompt_copying(tmp: Path) -> Scenario:
    """One stream of edit requests whose answers repeat 70% of their words from the prompt; no speculation."""
    rng = random.Random(22)
    recs = closed_loop(10, 1, lambda i, t: dataclasses.replace(
        req(i, t, itl=jitter(rng, 20, 0.05)), num_output_words=100, num_copied_words=70))
    return [write(tmp / "r.json", [run("concurrency=1", recs, concurrency=1)])], [], None, None


def multi_turn_sessions(tmp: Path, *, cached_share: float, tier: bool, kv: float) -> list[str]:
    """`kvpilot bench --dataset multi-turn`: 8 sessions of 4 turns (64 words a turn, 16 out) at 4 in flight; each
    returning turn resends its history. The server reports ``cached_share`` of that history cached (with
    ``tier``: copied back from the offload tier) and prefills 0.5 ms a computed token."""
    rows: list[RequestRecord] = []
    t = 0.0
    for turn in range(4):
        for s in range(8):
            prompt = 64 + turn * 80
            history = prompt - 64
            cached = int(history * cached_share)
            r = req(len(rows), t, prompt=prompt, cached=cached, prefill=0.5 * (prompt - cached), num_out=16,
                    group=f"session-{s}")
            server = dataclasses.replace(r.server, num_tier_cached_tokens=cached if tier else 0)
            rows.append(dataclasses.replace(r, item_id=s, turn_index=turn, server=server,
                                            num_usage_cached_tokens=cached))
            t += 0.05
    dataset = DatasetConfig(kind="multi-turn", input_len=64, output_len=16, num_turns=4)
    metrics = samples(3, running=4, waiting=0, kv=kv)
    return [write(tmp / f"mt-{cached_share:g}-{tier}-{kv:g}.json", [run("multi-turn", rows, metrics=metrics)],
                  dataset=dataset)]


def prefix_recomputed(tmp: Path) -> Scenario:
    """Multi-turn sessions recomputing their whole history on a 95%-full pool with no KV offload tier."""
    return multi_turn_sessions(tmp, cached_share=0.0, tier=False, kv=0.95), [], None, None


SCENARIOS: dict[str, Callable[[Path], Scenario]] = {
    "queueing": queueing, "tokenization": tokenization, "kv-cache-pressure": kv_pressure,
    "prefill-bound": prefill_bound, "decode-bound": decode_bound, "static-batching": static_batching,
    "prefill-interrupts-decode": prefill_interrupts_decode, "long-short-mixing": long_short,
    "prefix-cache-miss": prefix_cache_miss, "network-overhead": network_overhead,
    "client-overload": client_overload, "memory-spillover": memory_spillover, "slo-floor": slo_floor,
    "prefix-blind-routing": prefix_blind_routing, "degraded-run": degraded_run, "replica-imbalance": replica_imbalance,
    "speculation-costs": speculation_costs, "prompt-copying": prompt_copying, "prefix-recomputed": prefix_recomputed,
}
