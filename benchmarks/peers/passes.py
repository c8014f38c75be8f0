"""Which passes count, and the medians and kvpilot/peer ratios drawn from them (pure: rows in, figures out).

A pass (one engine x workload x position in the run's sequence) is valid only when every request succeeded
and every one produced the tokens asked for: a failed or short request makes the engine look faster or
slower than it is, so such a pass is reported as dropped and never enters a median. A ratio compares a peer
pass with the mean of the valid kvpilot passes next to it in the sequence (run order alternates kvpilot,
peer, kvpilot, ...: slow drift of a shared machine cancels to first order); the figure reported is the median
of those per-pass ratios with their min-max, and only when at least `required` passes gave one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import mean, median

from peers.workloads import Row, Workload

MIN_VALID_PASSES = 3
"""A ratio or median is printed only from at least this many valid passes."""

Metric = Callable[[Row], "float | None"]


def row_problems(row: Row | None, workload: Workload) -> list[str]:
    """Why this pass cannot be used ([] when it can): no result, failed requests, fewer successful requests
    than sent, or a request that produced fewer tokens than asked."""
    if row is None:
        return ["no result"]
    problems = []
    if row.num_errors:
        problems.append(f"{row.num_errors} request errors")
    if row.num_ok < workload.num_requests:
        problems.append(f"{row.num_ok} of {workload.num_requests} requests ok")
    if row.num_ok and row.min_output_tokens < workload.output_len:
        problems.append(f"a request produced {row.min_output_tokens} of {workload.output_len} tokens")
    return problems


@dataclass(frozen=True)
class Spread:
    """A median over valid passes with its min and max; `values` empty when no pass was valid."""

    values: tuple[float, ...]
    dropped: tuple[str, ...] = ()
    required: int = MIN_VALID_PASSES

    @property
    def enough(self) -> bool:
        return len(self.values) >= self.required

    @property
    def median(self) -> float | None:
        return median(self.values) if self.values else None

    def describe(self, digits: int = 1, suffix: str = "") -> str:
        """`1.62x (1.50-1.80x, 3 passes)`, or why there is no figure (fewer valid passes than required)."""
        if not self.enough:
            return f"no figure: {len(self.values)} valid of the {self.required} passes required"
        low, high, count = min(self.values), max(self.values), len(self.values)
        return (f"{self.median:,.{digits}f}{suffix} ({low:,.{digits}f}-{high:,.{digits}f}{suffix}, "
                f"{count} pass{'' if count == 1 else 'es'})")


@dataclass(frozen=True)
class RunRows:
    """One workload's rows of a run, by (engine label, position in the sequence), and the sequence of labels run."""

    sequence: tuple[str, ...]
    rows: dict[tuple[str, int], Row] = field(default_factory=dict)

    @classmethod
    def of(cls, sequence: Sequence[str], rows: Sequence[Row], workload: str) -> RunRows:
        return cls(tuple(sequence), {(r.engine, r.pass_index): r for r in rows if r.workload == workload})


def engine_spread(passes: RunRows, engine: str, workload: Workload, metric: Metric,
                  required: int = MIN_VALID_PASSES) -> Spread:
    """`metric` over the valid passes of `engine` at `workload`; the others are listed as dropped."""
    values, dropped = [], []
    for index, label in enumerate(passes.sequence):
        if label != engine:
            continue
        value, problems = _valid_value(passes, engine, index, workload, metric)
        if problems:
            dropped.append(f"pass {index} {engine}: {'; '.join(problems)}")
        else:
            values.append(value)
    return Spread(tuple(values), tuple(dropped), required)


def ratio_spread(passes: RunRows, ours: str, peer: str, workload: Workload, metric: Metric,
                 required: int = MIN_VALID_PASSES) -> Spread:
    """ours/peer of `metric`, one value per valid peer pass against the mean of its valid `ours` neighbours
    (the passes just before and after it in the sequence). A peer pass with no valid neighbour is dropped."""
    values, dropped = [], []
    for index, label in enumerate(passes.sequence):
        if label != peer:
            continue
        peer_value, problems = _valid_value(passes, peer, index, workload, metric)
        neighbours = [(j, *_valid_value(passes, ours, j, workload, metric)) for j in (index - 1, index + 1)
                      if 0 <= j < len(passes.sequence) and passes.sequence[j] == ours]
        ours_values = [value for _, value, _ in neighbours if value is not None]
        if not problems and not ours_values:
            problems = [f"no valid {ours} pass beside it"] + [f"{ours} pass {j}: {'; '.join(ps)}"
                                                               for j, _, ps in neighbours]
        if problems:
            dropped.append(f"pass {index} {peer}: {'; '.join(problems)}")
        else:
            values.append(mean(ours_values) / peer_value)
    return Spread(tuple(values), tuple(dropped), required)


def _valid_value(passes: RunRows, engine: str, index: int, workload: Workload,
                 metric: Metric) -> tuple[float | None, list[str]]:
    """(the metric of a valid pass, None otherwise; why it is not valid). A zero is no value: no ratio."""
    row = passes.rows.get((engine, index))
    problems = row_problems(row, workload)
    if problems:
        return None, problems
    value = metric(row)
    if not value:
        return None, ["no value"]
    return value, []
