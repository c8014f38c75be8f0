"""Scrape a Prometheus ``/metrics`` endpoint before/during/after a run: vLLM's names (old and new, which kvpilot
exports too), SGLang's (``sglang:``), llama-server's (``llamacpp:``, with ``--metrics``) and TGI's (``tgi_``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Normalised key -> accepted sample names, newest first (vLLM V1, then V0 names), then the other engines' (one
# engine serves at a time, so the first name present is its). llama-server's "processing" requests hold a slot
# (running) and its "deferred" ones wait for one. The memory keys (kvpilot's /proc gauges, node_exporter's host
# swap as a fallback) feed the doctor's memory-spillover rule.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
                "tgi_batch_current_size"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred",
                "tgi_queue_size"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                 "llamacpp:kv_cache_usage_ratio"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions", "sglang:num_retracted_requests_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_hit_rate": ("vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate"),
    # llama-server counts the prompt tokens its cache served apart from those it processed: hits over the run are
    # the first, lookups both (summarize)
    "cached_prompt_tokens": ("llamacpp:prompt_tokens_cached_total",),
    "processed_prompt_tokens": ("llamacpp:prompt_tokens_total",),
    # KV offload tiers (vLLM's connector counters; kvpilot's --kv-offloading-size), apart from the pool's hits
    "external_prefix_queries": ("vllm:external_prefix_cache_queries_total",),
    "external_prefix_hits": ("vllm:external_prefix_cache_hits_total",),
    "process_resident": ("kvpilot:process_resident_bytes",),
    "process_swap": ("kvpilot:process_swap_bytes",),
    "major_faults": ("kvpilot:process_major_page_faults_total",),
    "swap_total_bytes": ("kvpilot:host_swap_total_bytes", "node_memory_SwapTotal_bytes"),
    "swap_free_bytes": ("kvpilot:host_swap_free_bytes", "node_memory_SwapFree_bytes"),
}


@dataclass(frozen=True)
class MetricsSample:
    """One scrape: ``t_s`` on the run clock, ``phase`` before/during/after, normalised values
    (summed over label sets, e.g. over several engines)."""

    t_s: float
    phase: str
    values: dict[str, float]


RATIO_KEYS = frozenset({"kv_usage", "prefix_hit_rate"})
_KNOWN_PREFIXES: tuple[str, ...] = tuple(name for names in METRIC_NAMES.values() for name in names)


def known_samples(text: str, prefixes: tuple[str, ...] = _KNOWN_PREFIXES) -> str:
    """Only the sample lines of :data:`METRIC_NAMES` series (or of ``prefixes``). The full exposition (~30 KB
    of histogram buckets on kvpilot, more on vLLM) takes ~15 ms to parse: a stall of the load generator's event
    loop on every scrape, which inflated its measured latencies and its own loop-lag verdict."""
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes))


def normalise(sums: dict[str, float], counts: dict[str, int],
              names: dict[str, tuple[str, ...]] = METRIC_NAMES) -> dict[str, float]:
    """Per-sample-name sums and label-set counts -> normalised values (keys of ``names`` that are present,
    the newest name winning): sums, except ratios (:data:`RATIO_KEYS`), which are averaged."""
    out: dict[str, float] = {}
    for key, candidates in names.items():
        name = next((n for n in candidates if n in sums), None)
        if name is not None:
            out[key] = sums[name] / counts[name] if key in RATIO_KEYS else sums[name]
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> normalised values (keys of :data:`METRIC_NAMES` that are present).

    Several label sets (e.g. one per engine) are summed, except ratios, which are averaged.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(known_samples(text)):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
            counts[sample.name] = counts.get(sample.name, 0) + 1
    return normalise(sums, counts)


@dataclass(frozen=True)
class MetricsSummary:
    """Server-side view over a run; None where the server exposes no such metric. Memory: the server
    process's swapped-out bytes (peak, and as a share of its resident + swapped bytes), its major page
    faults (after minus before) and the host's swap in use (peak), all in bytes or counts."""

    num_samples: int
    kv_usage_max: float | None
    kv_usage_mean: float | None
    waiting_max: float | None
    waiting_mean: float | None
    running_max: float | None
    num_preemptions: float | None
    prefix_cache_hit_rate: float | None
    process_swap_max: float | None = None
    process_swap_share_max: float | None = None
    major_faults: float | None = None
    host_swap_used_max: float | None = None
    prefix_cache_hits: float | None = None
    external_prefix_cache_hits: float | None = None
    external_prefix_cache_queries: float | None = None
    """Prompt tokens over the run (after minus before): served by the KV pool's prefix cache, and looked up in /
    copied back from a KV offload tier (vLLM's external_prefix_cache_* counters; None: not exported)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _series(samples: list[MetricsSample], key: str) -> list[float]:
    return [s.values[key] for s in samples if key in s.values]


def max_present(values: Iterable[float | None]) -> float | None:
    """The largest value that is not None; None when there is none."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def swap_share(values: dict[str, float]) -> float | None:
    """Share of the server process's memory that is swapped out: swap / (resident + swap), from one
    scrape's normalised values; None without both gauges."""
    swap, rss = values.get("process_swap"), values.get("process_resident")
    return swap / (swap + rss) if swap is not None and rss is not None and swap + rss > 0 else None


def host_swap_used(values: dict[str, float]) -> float | None:
    """Host swap in use (total - free), bytes; None without both gauges."""
    total, free = values.get("swap_total_bytes"), values.get("swap_free_bytes")
    return total - free if total is not None and free is not None else None


def summarize(samples: list[MetricsSample]) -> MetricsSummary:
    """Gauges over the during-phase; counters as after minus before."""
    during = [s for s in samples if s.phase == "during"] or samples

    def stat(key: str, fn: Any) -> float | None:
        vals = _series(during, key)
        return float(fn(vals)) if vals else None

    def delta(key: str) -> float | None:
        vals = _series(samples, key)
        return vals[-1] - vals[0] if len(vals) >= 2 else None

    queries, hits = delta("prefix_queries"), delta("prefix_hits")
    cached, processed = delta("cached_prompt_tokens"), delta("processed_prompt_tokens")
    if queries is None and cached is not None and processed is not None:  # llama-server's two counters
        queries, hits = cached + processed, cached
    hit_rate = hits / queries if queries and hits is not None else stat("prefix_hit_rate", max)
    return MetricsSummary(
        num_samples=len(samples),
        kv_usage_max=stat("kv_usage", max), kv_usage_mean=stat("kv_usage", lambda v: sum(v) / len(v)),
        waiting_max=stat("waiting", max), waiting_mean=stat("waiting", lambda v: sum(v) / len(v)),
        running_max=stat("running", max), num_preemptions=delta("preemptions"),
        prefix_cache_hit_rate=hit_rate,
        # memory over every scrape: a spill present before the load is still a spill
        process_swap_max=max_present(_series(samples, "process_swap")),
        process_swap_share_max=max_present([swap_share(s.values) for s in samples]),
        major_faults=delta("major_faults"), host_swap_used_max=max_present([host_swap_used(s.values) for s in samples]),
        prefix_cache_hits=hits, external_prefix_cache_hits=delta("external_prefix_hits"),
        external_prefix_cache_queries=delta("external_prefix_queries"),
    )


class Scraper:
    """Polls ``url`` every ``interval_s`` while running; failures are counted, never raised."""

    def __init__(self, http: httpx.AsyncClient, url: str, t0: float, interval_s: float = 1.0) -> None:
        self.http, self.url, self.t0, self.interval_s = http, url, t0, interval_s
        self.samples: list[MetricsSample] = []
        self.num_failures = 0
        self.last_error: str | None = None

    async def scrape(self, phase: str) -> None:
        try:
            resp = await self.http.get(self.url, timeout=5.0)
            resp.raise_for_status()
            values = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.num_failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return
        self.samples.append(MetricsSample(time.perf_counter() - self.t0, phase, values))

    async def poll(self, stop: asyncio.Event) -> None:
        await poll_until(self.scrape, stop, self.interval_s)


async def poll_until(scrape: Callable[[str], Awaitable[None]], stop: asyncio.Event, interval_s: float) -> None:
    """Calls ``scrape("during")`` every ``interval_s`` until ``stop`` is set (checked while waiting)."""
    while not stop.is_set():
        await scrape("during")
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            pass
