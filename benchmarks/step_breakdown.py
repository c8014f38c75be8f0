"""Where an offline run's wall time went, step by step (benchmarks/gpu_throughput.py --step-breakdown): steps
with prompt tokens (prefill or mixed: run eagerly) against decode-only steps (CUDA graphs where captured),
each step charged the wall time since the step before it completed, so the parts add up to the run. Steps
over 5x their kind's median (and 0.1 s) are counted apart: a Triton kernel compiling shows there."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from kvpilot.engine.engine import StepStats


@dataclass
class _Kind:
    num_steps: int = 0
    seconds: float = 0.0
    num_seqs: int = 0
    num_tokens: int = 0
    step_seconds: list[float] = field(default_factory=list)

    def add(self, seconds: float, stats: StepStats) -> None:
        self.num_steps += 1
        self.seconds += seconds
        self.step_seconds.append(seconds)
        self.num_seqs += stats.num_scheduled_seqs
        self.num_tokens += stats.num_batched_tokens

    def line(self, name: str, total: float) -> str:
        n = max(self.num_steps, 1)
        median = statistics.median(self.step_seconds) if self.step_seconds else 0.0
        # a step 5x the median and over 0.1 s is an outlier: a kernel compiling, a stall
        outliers = [t for t in self.step_seconds if t > max(5 * median, 0.1)]
        return (f"  {name:<12} {self.num_steps:6d} steps {self.seconds:8.2f} s ({self.seconds / max(total, 1e-9):5.1%})"
                f"  {self.seconds / n * 1e3:7.2f} ms a step (median {median * 1e3:.2f}, max "
                f"{max(self.step_seconds, default=0.0) * 1e3:.1f}), {self.num_seqs / n:6.1f} seqs and "
                f"{self.num_tokens / n:7.1f} tokens a step; {len(outliers)} outliers, {sum(outliers):.2f} s")


@dataclass
class StepBreakdown:
    """Observes engine steps (install with `watch(engine)`); `report()` after the run."""

    started: float = field(default_factory=time.perf_counter)
    last: float | None = None
    mixed: _Kind = field(default_factory=_Kind)
    decode: _Kind = field(default_factory=_Kind)
    num_preempted: int = 0

    def watch(self, engine) -> None:
        previous = engine.on_step
        self.started = time.perf_counter()

        def observe(stats: StepStats) -> None:
            if previous is not None:
                previous(stats)
            self.observe(stats)
        engine.on_step = observe

    def observe(self, stats: StepStats) -> None:
        now = time.perf_counter()
        seconds, self.last = now - (self.last if self.last is not None else self.started), now
        (self.mixed if stats.num_prefill_tokens else self.decode).add(seconds, stats)
        self.num_preempted += stats.num_preempted

    def report(self) -> str:
        total = (self.last or self.started) - self.started
        return "\n".join([f"step breakdown: {total:.2f} s in {self.mixed.num_steps + self.decode.num_steps} steps, "
                          f"{self.num_preempted} preemptions",
                          self.mixed.line("with prompt", total), self.decode.line("decode only", total)])
