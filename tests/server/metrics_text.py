"""Reading /metrics in tests: one sample value by name and labels."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(all_samples: dict, name: str, **labels: str) -> float:
    """0.0 when the series does not exist yet (a counter never incremented)."""
    matches = [v for (n, ls), v in all_samples.items() if n == name and set(labels.items()) <= set(ls)]
    return sum(matches) if matches else 0.0


def wait_idle(client: httpx.Client, timeout_s: float = 30.0) -> None:
    """Until the shared server runs and queues nothing: a test before may have left a stream it dropped, which
    the engine aborts a step or more later (its tokens would land in the next test's counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = samples(client)
        if value(now, "vllm:num_requests_running") + value(now, "vllm:num_requests_waiting") == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server still runs requests after {timeout_s} s")
        time.sleep(0.05)
