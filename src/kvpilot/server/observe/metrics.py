"""Prometheus metrics with vLLM's names and meanings (so its dashboards work), plus kvpilot's own.

One CollectorRegistry per app (never the global one), so tests can run several servers in one process.
The token counters move per engine step, as vLLM's do (its IterationStats): `vllm:generation_tokens` by
the tokens sampled in each step, `vllm:prompt_tokens` by a request's whole prompt in the step that
completed its prefill (its first token), once per request. So a long generation shows in the counters (and
the status line) while it runs, not in one jump at its end. Per-request histograms are observed once, when
the request's final output arrives; scheduler state (running,
waiting, KV usage, prefix-cache and preemption counters) is read at scrape time from the engine thread's
latest snapshot, so the gauges and counters are exactly the engine's. Where the process's memory lives
(resident, swapped out, major page faults, the host's swap) is read from /proc at scrape time too.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.engine.engine import StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.observe.batch_histogram import BatchHistogram
from kvpilot.server.core.engine_info import EngineInfo
from kvpilot.server.observe.proc_memory import HostSwap, ProcessMemory, read_host_swap, read_process_memory

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms line up with vLLM dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
MAX_TOKEN_BUCKET = 1_000_000
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class _SchedulerCollector(Collector):
    """Scrape-time view of the engine's latest SchedulerStats snapshot."""

    def __init__(self, snapshot: Callable[[], SchedulerStats | None], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        if stats is None:
            return
        labels = ["model_name"]
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self._model], value)
            yield family
        counters = [("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
                    ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits)]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self._model], value)
            yield family
        blocks = GaugeMetricFamily("kvpilot:kv_cache_blocks", "KV cache blocks by state.",
                                   labels=["model_name", "state"])
        for state, value in (("free", stats.num_free_blocks), ("cached", stats.num_cached_blocks),
                             ("used", stats.num_used_blocks), ("total", stats.num_total_blocks)):
            blocks.add_metric([self._model, state], value)
        yield blocks
        if stats.num_offload_blocks:
            yield from self._offload(stats)
        if stats.kv_transfer:
            yield from self._kv_transfer(stats)

    def _kv_transfer(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Disaggregation (--kv-role): blocks held for decode workers, and transfers, bytes and failures by
        direction (send: this prefill worker's sender; pull: this decode worker's pulls), timeouts."""
        held = GaugeMetricFamily("kvpilot:kv_transfer_held_blocks", "KV blocks held for a decode worker's pull.",
                                 labels=["model_name"])
        held.add_metric([self._model], stats.num_kv_held_blocks)
        yield held
        for name, doc, send, pull in (
                ("kvpilot:kv_transfers", "KV transfers completed.", stats.num_kv_transfers_sent,
                 stats.num_kv_transfers_pulled),
                ("kvpilot:kv_transfer_bytes", "KV bytes transferred.", stats.num_kv_transfer_sent_bytes,
                 stats.num_kv_transfer_pulled_bytes),
                ("kvpilot:kv_transfer_failures", "KV transfers that failed (a failed pull is recomputed or, "
                 "refused by the prefill worker, fails its request).", stats.num_kv_transfer_send_failures,
                 stats.num_kv_transfer_pull_failures)):
            family = CounterMetricFamily(name, doc, labels=["model_name", "direction"])
            family.add_metric([self._model, "send"], send)
            family.add_metric([self._model, "pull"], pull)
            yield family
        timeouts = CounterMetricFamily("kvpilot:kv_transfer_timeouts", "Held KV freed because no decode worker "
                                       "pulled it within --kv-transfer-timeout.", labels=["model_name"])
        timeouts.add_metric([self._model], stats.num_kv_transfer_timeouts)
        yield timeouts

    def _offload(self, stats: SchedulerStats) -> Iterator[Metric]:
        """KV offload (--kv-offloading-size): vLLM's external prefix-cache counters (the tiers' hits, apart from
        the pool's own prefix_cache_hits), the tiers' fill, and the blocks copied each way."""
        model = [self._model]
        for name, doc, value in (
                ("vllm:external_prefix_cache_queries", "External prefix cache queries from the KV offload "
                 "tiers, in tokens.", stats.offload_prefix_cache_queries),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits: prompt tokens whose KV was "
                 "copied back from a KV offload tier.", stats.offload_prefix_cache_hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        tiers = GaugeMetricFamily("kvpilot:kv_offload_blocks", "KV offload tier blocks by tier and state.",
                                  labels=["model_name", "tier", "state"])
        for tier, used, total in (("cpu", stats.num_offload_used_blocks, stats.num_offload_blocks),
                                  ("disk", stats.num_disk_offload_used_blocks, stats.num_disk_offload_blocks)):
            if total:
                tiers.add_metric([self._model, tier, "used"], used)
                tiers.add_metric([self._model, tier, "total"], total)
        yield tiers
        copies = CounterMetricFamily("kvpilot:kv_offload_copied_blocks", "KV blocks copied between the cache "
                                     "and the offload tiers: save (cache to host), load (host to cache), demote "
                                     "(to disk), disk_load (disk to cache), dropped (no tier slot free).",
                                     labels=["model_name", "direction"])
        for direction, value in (("save", stats.num_offload_saved_blocks), ("load", stats.num_offload_loaded_blocks),
                                 ("demote", stats.num_offload_demoted_blocks),
                                 ("disk_load", stats.num_offload_disk_loaded_blocks),
                                 ("dropped", stats.num_offload_dropped_blocks)):
            copies.add_metric([self._model, direction], value)
        yield copies
        yield self._overlapped(stats)

    def _overlapped(self, stats: SchedulerStats) -> Metric:
        family = CounterMetricFamily("kvpilot:kv_offload_overlapped_blocks", "Of the blocks loaded from the "
                                     "offload tiers (load, disk_load), those copied beside a step of other "
                                     "requests instead of before their own request's step.", labels=["model_name"])
        family.add_metric([self._model], stats.num_offload_overlapped_blocks)
        return family


class _CacheConfigCollector(Collector):
    """vLLM's `vllm:cache_config_info`: value 1, the KV cache's configuration in its labels (string values, as
    vLLM writes them). llm-d's endpoint picker and `kvpilot doctor` read block_size and num_gpu_blocks from it;
    absent until the engine has started."""

    def __init__(self, info: Callable[[], EngineInfo | None]) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        if info is None:
            return
        labels = {"block_size": str(info.kv.block_size), "num_gpu_blocks": str(info.kv.num_blocks),
                  "num_cpu_blocks": str(info.kv.num_offload_blocks), "cache_dtype": info.kv.dtype,
                  "enable_prefix_caching": str(info.enable_prefix_caching),
                  "kv_cache_memory_bytes": str(info.kv.budget_bytes)}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine's CacheConfig.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        yield family


class MemoryCollector(Collector):
    """Scrape-time view of the server process's memory and the host's swap (Linux /proc; on other
    systems, or where /proc is unreadable, these series are simply absent). No labels: one process."""

    def __init__(self, process: Callable[[], ProcessMemory | None] = read_process_memory,
                 host_swap: Callable[[], HostSwap | None] = read_host_swap) -> None:
        self._process, self._host_swap = process, host_swap

    def collect(self) -> Iterator[Metric]:
        mem, swap = self._process(), self._host_swap()
        if mem is not None and mem.resident_bytes is not None:
            yield GaugeMetricFamily("kvpilot:process_resident_bytes", "Resident memory of the server process "
                                    "(VmRSS of /proc/self/status), bytes.", value=mem.resident_bytes)
        if mem is not None and mem.swap_bytes is not None:
            yield GaugeMetricFamily("kvpilot:process_swap_bytes", "Memory of the server process swapped out "
                                    "to disk (VmSwap of /proc/self/status), bytes: weights or KV blocks there "
                                    "are read back from disk when a step touches them.", value=mem.swap_bytes)
        if mem is not None and mem.major_faults is not None:
            yield CounterMetricFamily("kvpilot:process_major_page_faults", "Page faults of the server process "
                                      "that waited for disk (majflt of /proc/self/stat): swap-ins and file "
                                      "reads.", value=mem.major_faults)
        if swap is not None:
            yield GaugeMetricFamily("kvpilot:host_swap_total_bytes", "Swap space of the host (SwapTotal of "
                                    "/proc/meminfo), bytes; node_exporter's node_memory_SwapTotal_bytes under "
                                    "kvpilot's prefix, so a Prometheus scraping both sees one owner per "
                                    "name.", value=swap.total_bytes)
            yield GaugeMetricFamily("kvpilot:host_swap_free_bytes", "Free swap space of the host (SwapFree "
                                    "of /proc/meminfo), bytes; node_exporter's node_memory_SwapFree_bytes "
                                    "under kvpilot's prefix.", value=swap.free_bytes)


class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, moved by each step that verified drafts (StepStats): verifications
    (`vllm:spec_decode_num_drafts`), drafted and accepted tokens, and accepted tokens by draft position
    (`position` label, 0 = the first draft). No samples until a step speculates."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        m = ["model_name"]
        self._name = model_name
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m,
                                  registry=registry)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m,
                                        registry=registry)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                           m, registry=registry)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ["model_name", "position"],
                                        registry=registry)

    def observe(self, stats: StepStats) -> None:
        name = self._name
        self.num_drafts.labels(name).inc(stats.num_drafts)
        self.num_draft_tokens.labels(name).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(name).inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(name, str(position)).inc(count)


class ServerMetrics:
    """All series of one server. Thread-safe (prometheus-client's own locks): the engine thread observes
    steps, the event loop observes requests."""

    def __init__(self, model_name: str, snapshot: Callable[[], SchedulerStats | None],
                 memory: Collector | None = None, info: Callable[[], EngineInfo | None] = lambda: None) -> None:
        """``memory``: where the process's memory figures come from (default: this process's /proc);
        ``info``: the engine's start-up facts once it is ready (for `vllm:cache_config_info`)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        # vLLM sizes these from max_model_len; the app exists before the engine does, so a fixed range.
        token_buckets = build_1_2_5_buckets(MAX_TOKEN_BUCKET)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Count of finished requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        # one value a token, observed a request at a time (batch_histogram.py)
        self.itl = BatchHistogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", m,
                                  [model_name], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", m,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase.", m,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Time spent in the DECODE phase.", m,
                                buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=token_buckets, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generation tokens per request.", m, buckets=token_buckets,
                                                   registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", m,
                                          buckets=token_buckets, registry=r)
        self.tokenization = Histogram("kvpilot:tokenization_time_seconds", "Prompt tokenization time.", m,
                                      buckets=FAST_BUCKETS, registry=r)
        self.serialization = Histogram("kvpilot:serialization_time_seconds",
                                       "Last token to final response handed to the client.", m,
                                       buckets=FAST_BUCKETS, registry=r)
        self.rejected = Counter("kvpilot:requests_rejected", "Requests refused before reaching the engine.",
                                ["model_name", "reason"], registry=r)
        self.spec = SpecDecodeCounters(model_name, r)
        # the children observed every step, looked up once (labels() validates and locks on every call)
        self._step_tokens = self.iteration_tokens.labels(model_name)
        self._generated_tokens = self.generation_tokens.labels(model_name)
        r.register(_SchedulerCollector(snapshot, model_name))
        r.register(memory if memory is not None else MemoryCollector())
        r.register(_CacheConfigCollector(info))

    def observe_step(self, stats: StepStats) -> None:
        """Once per engine step (LLMEngine.on_step, relayed by the EngineClient; any thread): the step's
        tokens, and the tokens it sampled for requests still running (StepStats.num_generated_tokens)."""
        self._step_tokens.observe(stats.num_batched_tokens)
        if stats.num_generated_tokens:
            self._generated_tokens.inc(stats.num_generated_tokens)
        if stats.num_drafts:
            self.spec.observe(stats)

    def observe_prefill_done(self, num_prompt_tokens: int) -> None:
        """Once per request, when its first token arrives (the step that completed its prefill): the whole
        prompt, prefix-cache hits included. Like vLLM (it counts a request's prompt_len in the iteration of
        its first output): a prompt recomputed after a preemption is not counted again, and a request
        aborted before its first token never counts."""
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def observe_finished(self, metrics: RequestMetrics) -> None:
        """Once per finished request (any reason, aborts included), from its final RequestOutput. E2E and the
        token-count histograms count every one; queue time only those scheduled; TTFT, prefill and decode only
        those that produced a first token (vLLM's rule: a request aborted while waiting has no TTFT; docs/
        server.md, Metrics). The token counters are not touched here: they moved step by step."""
        name = self.model_name
        self.request_success.labels(name, metrics.finish_reason or "abort").inc()
        self.request_prompt_tokens.labels(name).observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(metrics.num_generated_tokens)
        for histogram, value in ((self.ttft, metrics.ttft), (self.e2e, metrics.e2e_latency),
                                 (self.queue, metrics.queue_time), (self.prefill, metrics.prefill_time),
                                 (self.decode, metrics.decode_time)):
            if value is not None:
                histogram.labels(name).observe(value)
        self.itl.observe_many(metrics.inter_token_latencies)

    def observe_tokenization(self, seconds: float) -> None:
        self.tokenization.labels(self.model_name).observe(seconds)

    def observe_serialization(self, seconds: float) -> None:
        self.serialization.labels(self.model_name).observe(seconds)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
