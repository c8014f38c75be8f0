"""Speculative decoding in the server: `--speculative-config` checked before anything loads, vLLM's
vllm:spec_decode_* counters in /metrics (moved by each verifying step), and a response's "kvpilot" field (the
request's verifications, drafted and accepted tokens, acceptance rate and drafting time)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvpilot.cli import app

from kvpilot.engine.engine import StepStats
from kvpilot.engine.timeline import RequestMetrics
from kvpilot.server.observe.metrics import ServerMetrics
from kvpilot.server.observe.timings import RequestTimings, kvpilot_field


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _step(**spec: object) -> StepStats:
    return StepStats(num_batched_tokens=9, num_prefill_tokens=0, num_decode_tokens=9, num_scheduled_seqs=2,
                     num_preempted=0, num_generated_tokens=5, duration=0.01, **spec)  # type: ignore[arg-type]


def test_spec_decode_counters_follow_the_verifying_steps():
    metrics = ServerMetrics("m", lambda: None)
    metrics.observe_step(_step())  # no drafts: no spec series yet
    assert not any(name.startswith("vllm:spec_decode") for name, _ in _samples(metrics))
    metrics.observe_step(_step(num_drafts=2, num_draft_tokens=7, num_accepted_tokens=3,
                               num_accepted_tokens_per_pos=(2, 1, 0, 0)))
    metrics.observe_step(_step(num_drafts=1, num_draft_tokens=4, num_accepted_tokens=1,
                               num_accepted_tokens_per_pos=(1, 0, 0, 0)))
    found = _samples(metrics)
    model = (("model_name", "m"),)
    assert found[("vllm:spec_decode_num_drafts_total", model)] == 3
    assert found[("vllm:spec_decode_num_draft_tokens_total", model)] == 11
    assert found[("vllm:spec_decode_num_accepted_tokens_total", model)] == 4
    per_pos = [found[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*model, ("position", str(p))))]
               for p in range(4)]
    assert per_pos == [3, 1, 0, 0]


def test_a_response_reports_its_requests_speculation():
    base = dict(request_id="r", num_prompt_tokens=5, num_generated_tokens=9, num_cached_tokens=0, num_preemptions=0,
                finish_reason="length", tokenize_time=0.0, queue_time=0.0, prefill_time=0.01, ttft=0.01,
                decode_time=0.05, e2e_latency=0.06, inter_token_latencies=())
    timings = RequestTimings.build(arrival=0.0, tokenize_s=0.0, metrics=None, end=0.1)
    plain = kvpilot_field("r", RequestMetrics(**base), 5, timings)  # type: ignore[arg-type]
    assert "speculation" not in plain
    spec = RequestMetrics(**base, num_drafts=3, num_draft_tokens=12, num_accepted_tokens=5,  # type: ignore[arg-type]
                          draft_time=0.0123456)
    assert kvpilot_field("r", spec, 5, timings)["speculation"] == {"num_drafts": 3, "draft_tokens": 12,
                                                                    "accepted_tokens": 5, "acceptance_rate": 0.4167,
                                                                    "draft_ms": 12.346}
    assert spec.draft_acceptance_rate == 5 / 12


@pytest.mark.parametrize("config, field", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "eagle"}', "method"),
    ("{ngram}", "not valid JSON"),
])
def test_serve_refuses_a_bad_speculative_config_before_loading(config, field):
    result = CliRunner().invoke(app, ["serve", "--speculative-config", config])
    assert result.exit_code == 2 and field in result.output, result.output

