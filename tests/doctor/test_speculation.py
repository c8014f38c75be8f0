"""The speculation rules on synthetic bench results: speculation-costs (verify rows outweigh accepted drafts at
the measured load) and prompt-copying (answers copy their prompts while speculation is off), each firing and
each staying quiet; the inputs they read (copy counts, the `speculation` field, the spec_decode counters); the
fixes as other engines' flags; and what --verify judges them by."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvpilot.bench.breakdown import parse_kvpilot_field
from kvpilot.bench.prompt_copy import count_copied
from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.engine_flags import translate
from kvpilot.doctor.findings import Finding, Fix, Severity
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.prometheus import metrics_delta, parse_prometheus_text
from kvpilot.doctor.rules.prompt_copying import estimated_speedup
from kvpilot.doctor.server_config import ServerConfig
from kvpilot.doctor.verify import apply_flags, fix_flags, metric_for
from tests.doctor.builders import closed_loop, jitter, req, run, write

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def test_copied_words_continue_a_span_of_the_prompt() -> None:
    prompt = "Repeat: the quick brown fox jumps over the lazy dog."
    # "the quick brown" + "fox" and "quick brown fox" + "jumps" are in the prompt; "brown fox jumps" + "high" is not
    got = count_copied(prompt, "the quick brown fox jumps high and away")
    assert (got.num_output_words, got.num_copied_words) == (8, 2)
    whole = count_copied(prompt, "the quick brown fox jumps over the lazy dog.")
    assert whole.num_copied_words == whole.num_output_words - 3  # the first 3 words have no context
    assert count_copied("some other text entirely here", "the quick brown fox jumps").num_copied_words == 0


def test_speculation_field_is_read_from_the_response() -> None:
    payload = {"kvpilot": {"request_id": "r", "prompt_tokens": 9, "timings": {"e2e_ms": 5.0},
                           "speculation": {"num_drafts": 6, "draft_tokens": 20, "accepted_tokens": 11}}}
    t = parse_kvpilot_field(payload)
    assert t is not None and (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens) == (6, 20, 11)
    del payload["kvpilot"]["speculation"]
    plain = parse_kvpilot_field(payload)
    assert plain is not None and plain.num_drafts == 0


SPEC_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} 16
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafted}
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {pos0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {pos1}
"""


def _spec_metrics(drafts: float, pos0: float, pos1: float) -> str:
    return SPEC_METRICS.format(drafts=drafts, drafted=2 * drafts, accepted=pos0 + pos1, pos0=pos0, pos1=pos1)


def test_spec_decode_counters_by_position_and_over_an_interval() -> None:
    before = parse_prometheus_text(_spec_metrics(100, 50, 20))
    after = parse_prometheus_text(_spec_metrics(300, 130, 40))
    assert after.spec_accepted_per_pos == (130.0, 40.0)
    delta = metrics_delta(before, after)
    assert delta.get("spec_drafts") == 200 and delta.get("spec_accepted_tokens") == 100
    assert delta.spec_accepted_per_pos == (80.0, 20.0)


def _speculating(rec: RequestRecord, drafts: int, drafted: int, accepted: int) -> RequestRecord:
    assert rec.server is not None
    server = dataclasses.replace(rec.server, num_drafts=drafts, num_draft_tokens=drafted,
                                 num_accepted_tokens=accepted)
    return dataclasses.replace(rec, server=server)


def _spec_inputs(tmp_path: Path, concurrency: int, accepted: int, metrics: str | None = None) -> DoctorInputs:
    """32-token answers from 10 verifications of 4 drafts each, ``accepted`` of the 40 accepted."""
    rng = random.Random(concurrency)
    recs = closed_loop(3 * concurrency + 6, concurrency, lambda i, t: _speculating(
        req(i, t, itl=jitter(rng, 20, 0.05)), 10, 40, accepted))
    path = write(tmp_path / f"spec{concurrency}.json", [run(f"c{concurrency}", recs, concurrency=concurrency)])
    inputs = load_inputs([path])
    return dataclasses.replace(inputs, metrics=parse_prometheus_text(metrics)) if metrics else inputs


def _finding(inputs: DoctorInputs, rule_id: str) -> Finding | None:
    return next((f for f in diagnose(inputs).findings if f.rule_id == rule_id), None)


def test_speculation_that_costs_at_a_busy_load_is_found_with_a_batch_cap(tmp_path: Path) -> None:
    """16 in flight, 6 of 40 drafts accepted: with the engine's prior a row costs 16/24 of a token, so a
    verification of 4 drafts takes 3.7 rows' time for 1.6 tokens. The geometric fit puts the first draft at
    38%, which a row costs from 0.38 / (1/8 x 0.62) = 4.9 requests on: drafting stops from 4."""
    f = _finding(_spec_inputs(tmp_path, 16, accepted=6), "speculation-costs")
    assert f is not None and f.severity is Severity.HIGH
    numbers = {e.name: e.value for e in f.evidence}
    assert numbers["accepted tokens per verification"] == pytest.approx(0.6)
    assert numbers["tokens per step time vs plain decoding"] == pytest.approx(1.6 / (1 + 4 * 16 / 24), rel=0.05)
    assert f.fixes[0].kvpilot == "--speculative-config '{<your fields>, \"disable_by_batch_size\": 4}'"
    assert fix_flags(f.fixes[0], "kvpilot") is None  # the server's own config is not known: a placeholder
    assert "drop --speculative-config" in f.fixes[-1].action
    served = _spec_inputs(tmp_path, 16, accepted=6)  # as `--serve "... --speculative-config {...}"` reports it
    served = dataclasses.replace(served, server_config=ServerConfig("--serve flags", speculative_config=NGRAM))
    fixed = _finding(served, "speculation-costs")
    assert fixed is not None and fixed.fixes[0].kvpilot == (
        '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"disable_by_batch_size": 4}\'')
    assert fix_flags(fixed.fixes[0], "kvpilot") is not None  # a concrete flag --verify can apply


def test_per_position_acceptance_cuts_the_drafts_to_those_that_pay(tmp_path: Path) -> None:
    """Position 1 accepted 90% of the time, position 2 10%: at 4 in flight a row costs 1/3 of a token, so
    one draft pays and the second does not."""
    metrics = _spec_metrics(1000, 900, 100)
    f = _finding(_spec_inputs(tmp_path, 4, accepted=10, metrics=metrics), "speculation-costs")
    assert f is not None
    rates = [e.value for e in f.evidence if e.name.startswith("acceptance at draft position")]
    assert rates == pytest.approx([0.9, 0.1])
    assert f.fixes[0].kvpilot == "--speculative-config '{<your fields>, \"num_speculative_tokens\": 1}'"


def test_speculation_that_pays_or_is_off_is_quiet(tmp_path: Path) -> None:
    assert _finding(_spec_inputs(tmp_path, 1, accepted=6), "speculation-costs") is None  # one stream: rows free
    assert _finding(_spec_inputs(tmp_path, 16, accepted=36), "speculation-costs") is None  # 90% accepted
    rng = random.Random(1)
    plain = closed_loop(40, 16, lambda i, t: req(i, t, itl=jitter(rng, 20, 0.05)))
    path = write(tmp_path / "plain.json", [run("c16", plain, concurrency=16)])
    assert _finding(load_inputs([path]), "speculation-costs") is None


def _copying_inputs(tmp_path: Path, concurrency: int, copied: int, spec: bool = False) -> DoctorInputs:
    rng = random.Random(concurrency)

    def make(i: int, t: float) -> RequestRecord:
        rec = dataclasses.replace(req(i, t, itl=jitter(rng, 20, 0.05)), num_output_words=100, num_copied_words=copied)
        return _speculating(rec, 10, 40, 30) if spec else rec

    recs = closed_loop(3 * concurrency + 6, concurrency, make)
    return load_inputs([write(tmp_path / f"copy{concurrency}{spec}.json",
                              [run(f"c{concurrency}", recs, concurrency=concurrency)])])


def test_answers_that_copy_their_prompts_suggest_ngram_speculation(tmp_path: Path) -> None:
    """70% of the words copied, one stream: 4 drafts accepted at 0.7, 0.49, ... for a row price of 1/9."""
    f = _finding(_copying_inputs(tmp_path, 1, copied=70), "prompt-copying")
    assert f is not None and f.severity is Severity.MEDIUM  # above LOW: --verify tries its fix
    expected, k = estimated_speedup(0.7, 1 / 9)
    assert k == 4 and expected == pytest.approx((1 + 0.7 + 0.49 + 0.343 + 0.2401) / (1 + 4 / 9))
    numbers = {e.name: e.value for e in f.evidence}
    assert numbers["output words that continue a span of the prompt"] == pytest.approx(0.7)
    assert numbers["estimated decode speed-up with 4 n-gram drafts"] == pytest.approx(expected)
    assert f.fixes[0].kvpilot == f"--speculative-config '{NGRAM}'" == f.fixes[0].vllm


def test_prompt_copying_stays_quiet_without_copies_load_headroom_or_when_on(tmp_path: Path) -> None:
    assert _finding(_copying_inputs(tmp_path, 1, copied=5), "prompt-copying") is None  # chat-like answers
    assert _finding(_copying_inputs(tmp_path, 16, copied=70), "prompt-copying") is None  # busy: not memory-bound
    assert _finding(_copying_inputs(tmp_path, 1, copied=70, spec=True), "prompt-copying") is None  # already on


def test_speculation_fixes_as_other_engines_flags() -> None:
    fix = Fix("x", kvpilot=f"--speculative-config '{NGRAM}'", vllm=f"--speculative-config '{NGRAM}'")
    assert translate(fix, "sglang", None) == "--speculative-algorithm NGRAM --speculative-num-draft-tokens 4"
    assert translate(fix, "llama.cpp", None) == "--spec-type ngram-simple --draft-max 4"
    assert translate(fix, "tgi", None) == "--speculate 4"
    capped = Fix("x", vllm="--speculative-config '{\"method\": \"ngram\", \"disable_by_batch_size\": 4}'")
    assert translate(capped, "sglang", None) == ""  # no such flag there: the action says what to do


def test_verify_applies_the_config_and_judges_copying_at_one_stream(tmp_path: Path) -> None:
    argv = ["kvpilot", "serve", "m", "--speculative-config", '{"method": "ngram"}', "--max-num-seqs", "8"]
    flags = fix_flags(Fix("x", kvpilot=f"--speculative-config '{NGRAM}'"), "kvpilot")
    assert flags is not None
    assert apply_flags(argv, flags) == ["kvpilot", "serve", "m", "--max-num-seqs", "8", "--speculative-config", NGRAM]
    inputs = _copying_inputs(tmp_path, 1, copied=70)
    metric = metric_for("prompt-copying")
    assert metric.lower_is_better and metric.measure(inputs) == pytest.approx(20.0, rel=0.06)
    assert metric_for("speculation-costs").name == "output throughput at the highest load"



def test_vllm_counters_alone_show_the_cost_and_that_speculation_is_on(tmp_path: Path) -> None:
    """A vLLM server: no per-request field, only the spec_decode counters (1000 verifications of 2 drafts,
    30% then 5% accepted) at 16 in flight; answers that copy are then not told to turn it on."""
    rng = random.Random(9)
    recs = closed_loop(40, 16, lambda i, t: dataclasses.replace(
        req(i, t, itl=jitter(rng, 20, 0.05), server=False), num_output_words=100, num_copied_words=70))
    inputs = load_inputs([write(tmp_path / "vllm.json", [run("c16", recs, concurrency=16)])])
    inputs = dataclasses.replace(inputs, metrics=parse_prometheus_text(_spec_metrics(1000, 300, 50)))
    f = _finding(inputs, "speculation-costs")
    assert f is not None and f.evidence[0].source == "vllm:spec_decode_* counters"
    assert {e.name: e.value for e in f.evidence}["accepted tokens per verification"] == pytest.approx(0.35)
    assert _finding(inputs, "prompt-copying") is None


def test_the_roofline_prices_draft_rows_when_given(tmp_path: Path) -> None:
    """Llama-3.1-8B on an H100, measured at 1 and 8 in flight (the roofline's line runs through its batch-1 step
    and its step at the peak load): one stream's step is a weight read, so a row is nearly free, and the copying
    estimate says the roofline priced it. (With one load only, the roofline has no second point: the prior.)"""
    rng = random.Random(10)

    def make(i: int, t: float) -> RequestRecord:
        return dataclasses.replace(req(i, t, itl=jitter(rng, 20, 0.05)), num_output_words=100, num_copied_words=70)

    runs = [run("c1", closed_loop(10, 1, make), concurrency=1), run("c8", closed_loop(24, 8, make), concurrency=8)]
    path = write(tmp_path / "copy.json", runs)
    f = _finding(load_inputs([path], model="llama-3.1-8b", gpu="h100-sxm"), "prompt-copying")
    assert f is not None
    price = next(e for e in f.evidence if e.name.startswith("cost of one draft row"))
    assert "roofline of llama-3.1-8b on h100-sxm" in price.source and price.value < 1 / 9
