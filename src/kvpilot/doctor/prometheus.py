"""Prometheus ``/metrics`` text of any engine the doctor reads -> one engine-neutral snapshot.

kvpilot serves vLLM's names, so one table covers both; where vLLM renamed a series (V0 -> V1) the newest name
wins when both are present. SGLang's (``sglang:``), llama-server's (``llamacpp:``) and TGI's (``tgi_``) names map
to the same keys, so the rules never ask which engine it was (``MetricsSnapshot.engine`` says, for the fixes).
Several label sets (engines, finish reasons, TP ranks) are summed, ratios averaged.

llama-server has no latency histograms: its counters of generated tokens and the slot time spent generating
them give the mean time per output token (the "itl" key), and its cached and processed prompt-token counters
give the prefix-cache hit rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.bench.scrape import METRIC_NAMES, RATIO_KEYS, host_swap_used, swap_share
from kvpilot.doctor.engines import LLAMACPP, SGLANG, TGI, engine_from_metrics
from kvpilot.doctor.errors import DoctorInputError

KV_BLOCKS = "kvpilot:kv_cache_blocks{state=%s}"  # one labelled sample of the blocks gauge (free/cached/used/total)
KV_BLOCKS_TOTAL = KV_BLOCKS % "total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_POS_KEY = "spec_accepted_pos_"  # + the draft position (0 = the first draft): accepted tokens there

# Normalised key -> sample names, newest first: the bench's scrape table (one list of vLLM V0/V1 names for
# both tools), plus what only the diagnosis needs.
SCALARS: dict[str, tuple[str, ...]] = {
    **METRIC_NAMES,
    "swapped": ("vllm:num_requests_swapped",),
    "cpu_kv_usage": ("vllm:cpu_cache_usage_perc",),
    "num_finished": ("vllm:request_success_total", "sglang:num_requests_total", "tgi_request_success"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total", "llamacpp:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total",
                          "llamacpp:tokens_predicted_total"),
    "cached_prompt_tokens": ("llamacpp:prompt_tokens_cached_total",),  # llama-server counts these apart
    "decode_seconds": ("llamacpp:tokens_predicted_seconds_total",),
    "prompt_seconds": ("llamacpp:prompt_seconds_total",),  # engine time in batches that carried prompt tokens
    # the longest sequence since start: typed a counter (the parser adds _total), read as a gauge (never diffed)
    "max_seq_tokens": ("llamacpp:n_tokens_max_total", "llamacpp:n_tokens_max"),
    "kv_tokens_total": ("sglang:max_total_num_tokens",),
    "rejected": ("kvpilot:requests_rejected_total",),
    "kv_blocks_total": (KV_BLOCKS_TOTAL,),
    # pool occupancy (kvpilot): blocks no request holds, and those of them still holding a cached prefix (a
    # full pool evicts these first); vLLM's kv_cache_usage_perc counts both as free, as kvpilot's does
    "kv_blocks_free": (KV_BLOCKS % "free",),
    "kv_blocks_cached": (KV_BLOCKS % "cached",),
    "process_cpu": ("process_cpu_seconds_total",),
    # speculative decoding (vLLM's names, kvpilot's too): verifications, drafted and accepted tokens
    "spec_drafts": ("vllm:spec_decode_num_drafts_total",),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
}
COUNTERS = frozenset({"preemptions", "prefix_queries", "prefix_hits", "num_finished", "prompt_tokens",
                      "generation_tokens", "rejected", "major_faults", "process_cpu", "cached_prompt_tokens",
                      "decode_seconds", "prompt_seconds", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"})
RATIOS = RATIO_KEYS | {"cpu_kv_usage"}
# Histogram key -> base names (samples are <base>_sum / <base>_count), newest first. Seconds.
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "vllm:request_time_per_output_token_seconds", "sglang:inter_token_latency_seconds",
            "tgi_request_mean_time_per_token_duration"),
    "e2e": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds", "tgi_request_duration"),
    "queue": ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds", "tgi_request_queue_duration"),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "tokenize": ("kvpilot:tokenization_time_seconds",),
    "iteration_tokens": ("vllm:iteration_tokens_total",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
}
TOKEN_HISTOGRAMS = frozenset({"iteration_tokens", "request_prompt_tokens"})
"""Histograms of token counts, not seconds (no mean_ms)."""
INFO_NAMES = ("vllm:cache_config_info",)


@dataclass(frozen=True)
class HistogramSum:
    """Count and sum of one histogram (summed over label sets); ``buckets``: (upper bound, cumulative count)
    in ascending order, +Inf last (empty when the text had none)."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def count_above(self, value: float) -> float | None:
        """Observations above the smallest bucket bound >= ``value`` (a lower bound of those above ``value``);
        None without buckets or such a bound."""
        cum = next((c for le, c in self.buckets if le >= value), None)
        return None if cum is None else self.count - cum

    def edge_at_most(self, value: float) -> float | None:
        """The largest bucket bound <= ``value`` (None: none), so that :meth:`count_above` of it counts every
        observation above ``value`` (and some just below it)."""
        return max((le for le, _ in self.buckets if le <= value), default=None)

    def minus(self, before: HistogramSum) -> HistogramSum:
        """This histogram over the interval since ``before`` (buckets by bound)."""
        prior = dict(before.buckets)
        return HistogramSum(self.count - before.count, self.total - before.total,
                            tuple((le, c - prior.get(le, 0.0)) for le, c in self.buckets))


@dataclass(frozen=True)
class MetricsSnapshot:
    """Normalised values of one scrape, or the difference of two (counters and histograms as
    after - before, gauges as after; ``interval`` is True then). ``names`` maps each key to the metric
    name it came from."""

    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramSum] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    interval: bool = False
    engine: str | None = None  # whose metric names these are (kvpilot.doctor.engines), None: not told

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def mean_ms(self, key: str) -> float | None:
        """Mean of a seconds histogram in ms (None when absent or empty)."""
        h = self.histograms.get(key)
        mean = h.mean if h is not None else None
        return None if mean is None or key in TOKEN_HISTOGRAMS else mean * 1000.0

    @property
    def swap_used_bytes(self) -> float | None:
        """Host swap in use (kvpilot's or node_exporter's gauges), bytes."""
        return host_swap_used(self.values)

    @property
    def process_swap_share(self) -> float | None:
        """Share of the server process's memory swapped out (kvpilot's /proc gauges)."""
        return swap_share(self.values)

    @property
    def prefix_caching_enabled(self) -> bool | None:
        flag = self.info.get("enable_prefix_caching")
        return None if flag is None else flag.lower() == "true"

    @property
    def spec_accepted_per_pos(self) -> tuple[float, ...]:
        """Accepted draft tokens by draft position (0 first), from ``vllm:spec_decode_num_accepted_tokens_per_pos``;
        empty when the server does not report it."""
        found = {int(k[len(SPEC_POS_KEY):]): v for k, v in self.values.items() if k.startswith(SPEC_POS_KEY)}
        return tuple(found.get(i, 0.0) for i in range(max(found) + 1)) if found else ()

    @property
    def flavor(self) -> str:
        """Which naming the server used: "vllm-v0" (old names), "vllm-v1" (kvpilot uses these), or another
        engine's ("sglang", "llama.cpp", "tgi")."""
        if self.engine in (SGLANG, LLAMACPP, TGI):
            return self.engine
        return "vllm-v0" if self.names.get("kv_usage") == "vllm:gpu_cache_usage_perc" else "vllm-v1"


def _sample_sums(text: str) -> tuple[dict[str, float], dict[str, int], dict[str, str],
                                      dict[str, dict[float, float]]]:
    buckets: dict[str, dict[float, float]] = {}  # histogram base -> upper bound -> cumulative count
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError) as exc:
        raise DoctorInputError(f"cannot parse Prometheus text: {exc}. Pass the raw output of "
                               f"`curl <server>/metrics` to --metrics-file") from exc
    for family in families:
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if s.name in INFO_NAMES:
                info.update({k: str(v) for k, v in s.labels.items()})
            if s.name == "kvpilot:kv_cache_blocks" and s.labels.get("state"):
                key = KV_BLOCKS % s.labels["state"]
                sums[key] = sums.get(key, 0.0) + float(s.value)
                counts[key] = counts.get(key, 0) + 1
            if s.name.endswith("_bucket") and "le" in s.labels:
                by_le = buckets.setdefault(s.name[:-len("_bucket")], {})
                le = float(s.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + float(s.value)
            if s.name == SPEC_PER_POS and str(s.labels.get("position", "")).isdigit():
                key = SPEC_POS_KEY + s.labels["position"]
                sums[key] = sums.get(key, 0.0) + float(s.value)
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
            counts[s.name] = counts.get(s.name, 0) + 1
    return sums, counts, info, buckets


def parse_prometheus_text(text: str) -> MetricsSnapshot:
    """Raises :class:`DoctorInputError` for text that is not Prometheus exposition format or that
    holds none of the known series."""
    sums, counts, info, buckets = _sample_sums(text)
    values: dict[str, float] = {}
    names: dict[str, str] = {}
    for key, candidates in SCALARS.items():
        name = next((n for n in candidates if n in sums), None)
        if name is not None:
            values[key] = sums[name] / counts[name] if key in RATIOS else sums[name]
            names[key] = name
    histograms: dict[str, HistogramSum] = {}
    for key, bases in HISTOGRAMS.items():
        base = next((b for b in bases if b + "_count" in sums), None)
        if base is not None:
            histograms[key] = HistogramSum(sums[base + "_count"], sums.get(base + "_sum", 0.0),
                                           tuple(sorted(buckets.get(base, {}).items())))
            names[key] = base
    values.update({k: v for k, v in sums.items() if k.startswith(SPEC_POS_KEY)})
    if not values and not histograms:
        raise DoctorInputError("the metrics text has no series the doctor knows (e.g. vllm:num_requests_waiting, "
                               "sglang:num_queue_reqs, llamacpp:requests_deferred, tgi_queue_size): is it the "
                               "/metrics of a kvpilot, vLLM, SGLang, llama-server (--metrics) or TGI server?")
    _llamacpp_derived(values, histograms, names)
    return MetricsSnapshot(values, histograms, info, names, engine=engine_from_metrics(sums))


def _llamacpp_derived(values: dict[str, float], histograms: dict[str, HistogramSum], names: dict[str, str]) -> None:
    """llama-server's counters in the keys other engines fill directly (see the module docstring): prompt
    tokens served from its cache over all prompt tokens, and slot seconds spent generating per token."""
    cached, fresh = values.get("cached_prompt_tokens"), values.get("prompt_tokens")
    if cached is not None and fresh is not None and "prefix_queries" not in values:
        values["prefix_hits"], values["prefix_queries"] = cached, cached + fresh
        names["prefix_hits"] = names["prefix_queries"] = names["cached_prompt_tokens"]
    seconds, tokens = values.get("decode_seconds"), values.get("generation_tokens")
    if seconds is not None and tokens is not None and "itl" not in histograms:
        histograms["itl"] = HistogramSum(tokens, seconds)
        names["itl"] = names["decode_seconds"]


def metrics_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsSnapshot:
    """Counters and histograms over the interval between two scrapes; gauges as of ``after``."""
    values = dict(after.values)
    positions = {k for k in after.values if k.startswith(SPEC_POS_KEY)}
    for key in (COUNTERS | positions) & after.values.keys() & before.values.keys():
        values[key] = after.values[key] - before.values[key]
    histograms = dict(after.histograms)
    for key in after.histograms.keys() & before.histograms.keys():
        histograms[key] = after.histograms[key].minus(before.histograms[key])
    return MetricsSnapshot(values, histograms, {**before.info, **after.info}, {**before.names, **after.names},
                           interval=True, engine=after.engine or before.engine)
