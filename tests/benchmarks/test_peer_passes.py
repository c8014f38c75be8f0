"""benchmarks/peers: which passes count, medians with min-max, kvpilot/peer ratios of alternating passes,
and the report lines (pure functions: no servers)."""

from __future__ import annotations

import pytest

from peers.comparisons import Comparison, Contender, build_comparisons
from peers.passes import RunRows, Spread, engine_spread, ratio_spread, row_problems
from peers.report import comparison_lines, memory_lines, rows_table
from peers.workloads import Row, Workload

C16 = Workload("c16", 16, 128, 128, num_requests=64, num_warmup_requests=16)
PREFILL = Workload("prefill", 4, 512, 1, num_requests=32, num_warmup_requests=4, is_prefill=True)


def row(engine: str, pass_index: int, out: float, *, workload: Workload = C16, ok: int | None = None,
        errors: int = 0, min_out: int | None = None, ttft: float | None = 100.0, itl: float | None = 10.0,
        rss: float | None = None) -> Row:
    ok = workload.num_requests if ok is None else ok
    min_out = workload.output_len if min_out is None else min_out
    return Row(engine, workload.name, pass_index, output_tok_s=out, prompt_tok_s=out * 10, ttft_p50_ms=ttft,
               itl_p50_ms=itl, tpot_p50_ms=itl, num_ok=ok, num_errors=errors, mean_output_tokens=float(min_out),
               client_overloaded=False, min_output_tokens=min_out, peak_rss_mib=rss)


def output(r: Row) -> float:
    return r.output_tok_s


def test_a_complete_pass_has_no_problems():
    assert row_problems(row("kvpilot", 0, 900.0), C16) == []


@pytest.mark.parametrize("bad, expected", [
    (dict(errors=2, ok=62), ["2 request errors", "62 of 64 requests ok"]),
    (dict(ok=60), ["60 of 64 requests ok"]),
    (dict(min_out=100), ["a request produced 100 of 128 tokens"]),
])
def test_failed_missing_or_short_requests_make_a_pass_unusable(bad, expected):
    assert row_problems(row("llamacpp", 1, 200.0, **bad), C16) == expected


def test_a_missing_row_is_a_problem_and_prefill_asks_one_token():
    assert row_problems(None, C16) == ["no result"]
    assert row_problems(row("kvpilot", 0, 1.0, workload=PREFILL), PREFILL) == []
    assert row_problems(row("kvpilot", 0, 1.0, workload=PREFILL, min_out=0), PREFILL) != []


def test_spread_gives_median_and_min_max_only_from_enough_passes():
    spread = Spread((1.5, 1.8, 1.6))
    assert spread.enough and spread.median == 1.6
    assert spread.describe(2, "x") == "1.60x (1.50-1.80x, 3 passes)"
    short = Spread((1.5, 1.8), ("pass 3 vllm: 2 request errors",))
    assert not short.enough
    assert short.describe() == "no figure: 2 valid of the 3 passes required"
    assert Spread(()).median is None


SEQUENCE = ["kvpilot", "peer", "kvpilot", "peer", "kvpilot", "peer", "kvpilot"]


def test_each_peer_pass_is_compared_with_the_mean_of_its_kvpilot_neighbours():
    rows = [row("kvpilot", 0, 1000.0), row("peer", 1, 500.0), row("kvpilot", 2, 1200.0), row("peer", 3, 550.0),
            row("kvpilot", 4, 1100.0), row("peer", 5, 600.0), row("kvpilot", 6, 1300.0)]
    run = RunRows.of(SEQUENCE, rows, "c16")
    ratios = ratio_spread(run, "kvpilot", "peer", C16, output)
    assert ratios.values == pytest.approx((1100 / 500, 1150 / 550, 1200 / 600))
    assert ratios.median == pytest.approx(1150 / 550) and ratios.dropped == ()
    engine = engine_spread(run, "kvpilot", C16, output)
    assert engine.values == (1000.0, 1200.0, 1100.0, 1300.0) and engine.median == 1150.0


def test_a_dropped_peer_pass_leaves_too_few_for_a_ratio_and_is_named():
    rows = [row("kvpilot", 0, 1000.0), row("peer", 1, 500.0), row("kvpilot", 2, 1000.0),
            row("peer", 3, 900.0, errors=3, ok=61), row("kvpilot", 4, 1000.0), row("peer", 5, 500.0),
            row("kvpilot", 6, 1000.0)]
    ratios = ratio_spread(RunRows.of(SEQUENCE, rows, "c16"), "kvpilot", "peer", C16, output)
    assert ratios.values == (2.0, 2.0) and not ratios.enough
    assert ratios.dropped == ("pass 3 peer: 3 request errors; 61 of 64 requests ok",)
    assert ratios.describe().startswith("no figure")


def test_an_invalid_kvpilot_neighbour_is_left_out_of_the_mean():
    rows = [row("kvpilot", 0, 1000.0, min_out=64), row("peer", 1, 500.0), row("kvpilot", 2, 1200.0)]
    ratios = ratio_spread(RunRows.of(SEQUENCE[:3], rows, "c16"), "kvpilot", "peer", C16, output, required=1)
    assert ratios.values == (1200 / 500,)
    assert engine_spread(RunRows.of(SEQUENCE[:3], rows, "c16"), "kvpilot", C16, output).dropped == (
        "pass 0 kvpilot: a request produced 64 of 128 tokens",)


def test_a_peer_pass_without_any_valid_kvpilot_beside_it_is_dropped():
    rows = [row("kvpilot", 0, 1000.0, errors=1, ok=63), row("peer", 1, 500.0)]  # the server after never started
    ratios = ratio_spread(RunRows.of(SEQUENCE[:3], rows, "c16"), "kvpilot", "peer", C16, output, required=1)
    assert ratios.values == ()
    assert ratios.dropped == ("pass 1 peer: no valid kvpilot pass beside it; kvpilot pass 0: 1 request errors; "
                              "63 of 64 requests ok; kvpilot pass 2: no result",)


def test_latency_ratios_skip_passes_without_a_value():
    rows = [row("kvpilot", 0, 1000.0, itl=10.0), row("peer", 1, 500.0, itl=None), row("kvpilot", 2, 1000.0)]
    ratios = ratio_spread(RunRows.of(SEQUENCE[:3], rows, "c16"), "kvpilot", "peer", C16, lambda r: r.itl_p50_ms,
                          required=1)
    assert ratios.values == () and ratios.dropped == ("pass 1 peer: no value",)


def test_rows_of_other_workloads_do_not_count():
    rows = [row("kvpilot", 0, 1000.0), row("peer", 1, 50.0, workload=PREFILL), row("kvpilot", 2, 1000.0)]
    ratios = ratio_spread(RunRows.of(SEQUENCE[:3], rows, "c16"), "kvpilot", "peer", C16, output, required=1)
    assert ratios.dropped == ("pass 1 peer: no result",)


def test_comparisons_alternate_kvpilot_with_every_peer_for_each_pass():
    default, bf16, q4_0, q4_k_m = build_comparisons(["default", "bf16", "q4_0", "q4_k_m"],
                                                    ["kvpilot", "llamacpp", "vllm"])
    assert [c.label for c in default.sequence(2)] == ["kvpilot", "llamacpp", "kvpilot", "vllm", "kvpilot",
                                                      "llamacpp", "kvpilot", "vllm", "kvpilot"]
    assert [c.label for c in bf16.sequence(3)] == ["kvpilot-bf16", "vllm-bf16"] * 3 + ["kvpilot-bf16"]
    assert (bf16.ours.weights, q4_0.ours.weights, q4_0.peers[0].weights) == ("bf16", "q4_0", "q4_0")
    assert q4_0.peers[0].slots_per_workload and not default.peers[0].slots_per_workload
    assert (bf16.engines(), q4_0.engines(), default.engines()) == ({"vllm"}, {"llamacpp"}, {"llamacpp", "vllm"})
    assert [(c.label, c.engine, c.weights, c.slots_per_workload) for c in q4_k_m.contenders()] == [
        ("kvpilot-q4_k_m", "kvpilot", "q4_k_m", False), ("llamacpp-q4_k_m", "llamacpp", "q4_k_m", True)]
    assert [c.label for c in q4_k_m.sequence(1)] == ["kvpilot-q4_k_m", "llamacpp-q4_k_m", "kvpilot-q4_k_m"]


def test_engines_shape_only_the_default_comparison():
    alone, = build_comparisons(["default"], ["kvpilot"])
    assert [c.label for c in alone.sequence(3)] == ["kvpilot"] * 3
    peers_only, = build_comparisons(["default"], ["vllm"])
    assert [c.label for c in peers_only.sequence(2)] == ["vllm", "vllm"]
    assert build_comparisons(["default"], ["kvpilot", "vllm"])[0].without({"vllm"}).peers == ()
    with pytest.raises(ValueError, match="choose from default,bf16,q4_0,q4_k_m"):
        build_comparisons(["int8"], ["kvpilot"])


def test_labels_are_unique_across_comparisons():
    labels = [c.label for comparison in build_comparisons(["default", "bf16", "q4_0", "q4_k_m"],
                                                          ["kvpilot", "llamacpp", "llamacpp-py", "vllm"])
              for c in (comparison.ours, *comparison.peers)]
    assert len(labels) == len(set(labels))


def test_comparison_lines_print_medians_ratios_and_dropped_passes():
    comparison = Comparison("q4_0", Contender("kvpilot-q4_0", "kvpilot", "q4_0"),
                            (Contender("llamacpp-q4_0", "llamacpp", "q4_0", slots_per_workload=True),))
    sequence = [c.label for c in comparison.sequence(3)]
    outs = [1000.0, 400.0, 1100.0, 500.0, 1200.0, 450.0, 1300.0]
    rows = [row(label, i, out) for i, (label, out) in enumerate(zip(sequence, outs))]
    lines = comparison_lines(comparison, sequence, rows, [C16])
    assert lines[0].startswith("# q4_0: kvpilot-q4_0 vs llamacpp-q4_0")
    assert "out tok/s 1,150.0 (1,000.0-1,300.0, 4 passes)" in lines[1]
    assert "out tok/s 450.0 (400.0-500.0, 3 passes)" in lines[2]
    assert "kvpilot-q4_0/llamacpp-q4_0" in lines[3] and "out tok/s 2.62x (2.30-2.78x, 3 passes)" in lines[3]
    assert "TTFT p50 1.00x" in lines[3] and "ITL p50 1.00x" in lines[3]

    rows[3] = row("llamacpp-q4_0", 3, 500.0, min_out=12)
    lines = comparison_lines(comparison, sequence, rows, [C16])
    assert "out tok/s no figure: 2 valid of the 3 passes required" in lines[3]
    assert lines[-1].endswith("dropped pass 3 llamacpp-q4_0: a request produced 12 of 128 tokens")


def test_prefill_is_judged_by_prompt_throughput_without_itl():
    comparison = Comparison("default", Contender("kvpilot", "kvpilot"), (Contender("vllm", "vllm"),))
    sequence = ["kvpilot", "vllm", "kvpilot"]
    rows = [row("kvpilot", 0, 300.0, workload=PREFILL, min_out=1), row("vllm", 1, 300.0, workload=PREFILL, min_out=1),
            row("kvpilot", 2, 300.0, workload=PREFILL, min_out=1)]
    lines = comparison_lines(comparison, sequence, rows, [PREFILL], required=1)
    assert "prompt tok/s 1.00x (1.00-1.00x, 1 pass)" in lines[3] and "ITL" not in lines[3]


def test_rows_table_marks_dropped_rows_and_shows_peak_rss():
    lines = rows_table([row("vllm", 1, 500.0, errors=1, ok=63), row("kvpilot", 0, 900.0, rss=1234.5)], {"c16": C16})
    assert len(lines) == 3 and "DROPPED" not in lines[1] and lines[0].endswith("peak RSS MiB")
    assert lines[1].endswith(" 1,234.5") and " - " in lines[2]  # no reading: a dash
    assert lines[2].endswith("DROPPED: 1 request errors; 63 of 64 requests ok")
    assert "DROPPED" not in "".join(rows_table([row("vllm", 1, 500.0, errors=1)]))  # no workloads: unjudged


def test_memory_lines_set_every_server_s_peak_rss_side_by_side():
    q4_0, q4_k_m = build_comparisons(["q4_0", "q4_k_m"], [])
    sequence = [c.label for comparison in (q4_0, q4_k_m) for c in comparison.sequence(1)]
    rss = {"kvpilot-q4_0": 300.0, "llamacpp-q4_0": 250.0, "kvpilot-q4_k_m": 320.0, "llamacpp-q4_k_m": 260.0}
    rows = [row(label, i, 100.0, rss=rss[label] + i) for i, label in enumerate(sequence)]
    rows[1] = row("llamacpp-q4_0", 1, 100.0, rss=None)  # no /proc reading
    lines = memory_lines(sequence, rows, [C16], required=1)
    assert lines[0].startswith("# peak RSS, MiB")
    assert lines[1:] == [
        f"c16      {'kvpilot-q4_0':<32} 301.0 MiB (300.0-302.0 MiB, 2 passes)",
        f"c16      {'llamacpp-q4_0':<32} no figure: 0 valid of the 1 passes required",
        f"c16      {'kvpilot-q4_k_m':<32} 324.0 MiB (323.0-325.0 MiB, 2 passes)",
        f"c16      {'llamacpp-q4_k_m':<32} 264.0 MiB (264.0-264.0 MiB, 1 pass)"]
