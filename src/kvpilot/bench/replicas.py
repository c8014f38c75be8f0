"""Where a multi-replica deployment's per-replica metrics come from, and scraping them during a run.

Two sources, one shape (:class:`ReplicaSample`):

- a labelled endpoint: ``GET <base>/metrics/replicas`` (kvpilot's Ray Serve app) serves every replica's own
  ``/metrics`` with two extra labels on every sample, ``replica="<id>"`` and ``lane="<pool>"``;
- a list of replica URLs (``--replica-url``, repeatable): plain kvpilot or vLLM servers, each scraped at
  ``<url>/metrics``; the replica's id is its URL.

With replica URLs and no ``--base-url`` bench also sends the load itself, round-robin over the URLs (what a
prefix-blind load balancer does). The per-run report (counter deltas, imbalance, prefix spread) is built
from these samples by :mod:`kvpilot.bench.replica_report`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.bench.scrape import METRIC_NAMES, RATIO_KEYS, MetricsSample, known_samples, normalise, poll_until

REPLICA_LABEL = "replica"
LANE_LABEL = "lane"
REPLICAS_PATH = "/metrics/replicas"

# The bench's scrape table plus the counters a replica's share of the load is read from when no request says
# which replica served it.
REPLICA_NAMES: dict[str, tuple[str, ...]] = {
    **METRIC_NAMES,
    "requests_ok": ("vllm:request_success_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
}
_REPLICA_PREFIXES: tuple[str, ...] = tuple(n for names in REPLICA_NAMES.values() for n in names)


def replica_id(url: str) -> str:
    """The id of a replica given by URL: the URL without a trailing slash (as records name it)."""
    return url.rstrip("/")


@dataclass(frozen=True)
class ReplicaPlan:
    """Where per-replica metrics come from, and whether bench spreads the load itself.

    Invariants: exactly one of ``labelled_url`` (one endpoint, samples labelled by replica) and ``urls``
    (one ``/metrics`` per replica, ids = :func:`replica_id` of each) is set; ``route`` implies ``urls``:
    requests go round-robin over them in the order given.
    """

    labelled_url: str | None = None
    urls: tuple[str, ...] = ()
    route: bool = False

    def __post_init__(self) -> None:
        if (self.labelled_url is None) == (not self.urls):
            raise ValueError("a replica plan needs either labelled_url or urls, not both")
        if self.route and not self.urls:
            raise ValueError("routing needs replica urls")

    @property
    def source(self) -> str:
        """Where the numbers came from, for reports."""
        return self.labelled_url if self.labelled_url is not None else "<url>/metrics of each replica URL"

    def to_json(self) -> dict[str, Any]:
        return {"labelled_url": self.labelled_url, "urls": [replica_id(u) for u in self.urls],
                "route": self.route}


@dataclass(frozen=True)
class ReplicaValues:
    """One replica in one scrape: its lane (None when the source names none) and normalised values
    (keys of :data:`REPLICA_NAMES` that are present; label sets within the replica summed, ratios averaged)."""

    lane: str | None
    values: dict[str, float]


@dataclass(frozen=True)
class ReplicaSample:
    """One scrape of every replica: ``t_s`` on the run clock, ``phase`` before/during/after. A replica whose
    scrape failed is absent (never zero-filled: a zero counter would read as a huge delta later)."""

    t_s: float
    phase: str
    replicas: dict[str, ReplicaValues] = field(default_factory=dict)


def _accumulate(samples: Any, sums: dict[str, float], counts: dict[str, int]) -> None:
    for sample in samples:
        if sample.name.endswith("_created"):
            continue
        sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
        counts[sample.name] = counts.get(sample.name, 0) + 1


def parse_replica_values(text: str, lane: str | None = None) -> ReplicaValues:
    """One server's own ``/metrics`` text -> its :class:`ReplicaValues` (label sets summed)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(known_samples(text, _REPLICA_PREFIXES)):
        _accumulate(family.samples, sums, counts)
    return ReplicaValues(lane, normalise(sums, counts, REPLICA_NAMES))


def parse_labelled(text: str) -> dict[str, ReplicaValues]:
    """``/metrics/replicas`` text -> replica id -> values, grouped by the ``replica`` label (samples without
    it are ignored); the lane is the replica's ``lane`` label (None when absent)."""
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    lanes: dict[str, str | None] = {}
    for family in text_string_to_metric_families(known_samples(text, _REPLICA_PREFIXES)):
        for sample in family.samples:
            rid = sample.labels.get(REPLICA_LABEL)
            if rid is None:
                continue
            lanes[rid] = lanes.get(rid) or sample.labels.get(LANE_LABEL)
            _accumulate([sample], sums.setdefault(rid, {}), counts.setdefault(rid, {}))
    return {rid: ReplicaValues(lanes[rid], normalise(sums[rid], counts[rid], REPLICA_NAMES)) for rid in sums}


def aggregate(sample: ReplicaSample, phase: str | None = None) -> MetricsSample:
    """The deployment as one server (the :data:`METRIC_NAMES` keys): values summed over replicas, ratios
    averaged, exactly as :func:`kvpilot.bench.scrape.parse_metrics` treats several label sets."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for rep in sample.replicas.values():
        for key, value in rep.values.items():
            if key in METRIC_NAMES:
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    values = {k: sums[k] / counts[k] if k in RATIO_KEYS else sums[k] for k in sums}
    return MetricsSample(sample.t_s, phase or sample.phase, values)


def detect_labelled(base_url: str, headers: dict[str, str], timeout_s: float = 5.0) -> str | None:
    """``<base_url>/metrics/replicas`` when it answers with at least one replica-labelled sample; None on a
    plain server (404), an error or no labelled sample. One request, before any load."""
    url = base_url.rstrip("/") + REPLICAS_PATH
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return url if parse_labelled(resp.text) else None
    except (httpx.HTTPError, ValueError):
        return None


class ReplicaScraper:
    """Scrapes every replica of ``plan`` every ``interval_s`` while running; failures are counted (with the
    last error), never raised. With replica URLs they are fetched concurrently, one sample per round."""

    def __init__(self, http: httpx.AsyncClient, plan: ReplicaPlan, t0: float, interval_s: float = 1.0) -> None:
        self.http, self.plan, self.t0, self.interval_s = http, plan, t0, interval_s
        self.samples: list[ReplicaSample] = []
        self.num_failures = 0
        self.last_error: str | None = None

    async def _get(self, url: str) -> str | None:
        try:
            resp = await self.http.get(url, timeout=5.0)
            resp.raise_for_status()
            return resp.text
        except httpx.HTTPError as exc:
            self.num_failures += 1
            self.last_error = f"{url}: {type(exc).__name__}: {exc}"
            return None

    async def scrape(self, phase: str) -> None:
        replicas: dict[str, ReplicaValues] = {}
        try:
            if self.plan.labelled_url is not None:
                text = await self._get(self.plan.labelled_url)
                replicas = parse_labelled(text) if text is not None else {}
            else:
                urls = self.plan.urls
                texts = await asyncio.gather(*(self._get(replica_id(u) + "/metrics") for u in urls))
                replicas = {replica_id(u): parse_replica_values(t) for u, t in zip(urls, texts, strict=True)
                            if t is not None}
        except ValueError as exc:  # unparsable exposition
            self.num_failures += 1
            self.last_error = f"ValueError: {exc}"
            return
        if replicas:
            self.samples.append(ReplicaSample(time.perf_counter() - self.t0, phase, replicas))

    async def poll(self, stop: asyncio.Event) -> None:
        await poll_until(self.scrape, stop, self.interval_s)

    def aggregate_samples(self) -> list[MetricsSample]:
        """The deployment-wide samples of a client-routed run (no aggregate endpoint to scrape): only rounds
        in which every replica answered, so counter deltas never jump with a missing replica."""
        want = len(self.plan.urls)
        return [aggregate(s) for s in self.samples if len(s.replicas) == want]
