"""How much live probing to do: phase sizes from the endpoint's limits and a measured baseline.

Pure functions, no I/O: :mod:`kvpilot.doctor.probe` measures, this module decides. Every phase is
bounded three ways, so a slow CPU server and a fast GPU one both finish in bounded time: a request
count, a send deadline (``LoadShape.duration_s``: no request starts after it) and the concurrency
(never more than ``ProbeLimits.max_in_flight`` requests at once, so a production server is safe).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape

DEFAULT_MAX_MODEL_LEN = 2048
"""Assumed context limit when ``/v1/models`` does not say (vLLM and kvpilot report ``max_model_len``)."""

TOKEN_SLACK = 1.25
"""Prompts are built with the bench tokenizer (approximate word counts without ``--tokenizer``); the
server may count up to this factor more tokens, so prompts are sized to fit even then."""


@dataclass(frozen=True)
class ProbeLimits:
    """The size of one probe session (``FULL`` or ``QUICK``).

    Invariants: ``ramp`` starts at 1 and increases (its first point is the baseline); its last value
    is ``max_in_flight``, the most requests ever in flight; ``phase_s`` is the send deadline of every
    phase after the baseline; ``max_requests`` caps each phase's request count.
    """

    name: str
    ramp: tuple[int, ...]
    output_len: int
    max_short_len: int
    max_long_len: int
    max_long_prefill_s: float
    phase_s: float
    num_baseline: int
    max_requests: int
    mixed_concurrency: int
    unique_control: bool
    find_knee: bool = False
    """Stop the ramp at the saturation knee (see :func:`knee_reason`) instead of running every point."""

    @property
    def max_in_flight(self) -> int:
        return self.ramp[-1]

    def capped(self, max_concurrency: int) -> ProbeLimits:
        """The same probe never sending more than ``max_concurrency`` at once (the ramp cut there)."""
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        top = min(max_concurrency, self.ramp[-1])
        ramp = tuple(n for n in self.ramp if n < top) + (top,)
        return replace(self, ramp=ramp, mixed_concurrency=min(self.mixed_concurrency, max_concurrency))

    def fixed_ramp(self, ramp: tuple[int, ...]) -> ProbeLimits:
        """This probe with exactly ``ramp`` (e.g. to repeat an earlier probe's points for a fair comparison)."""
        return replace(self, ramp=ramp, find_knee=False)


FULL = ProbeLimits(name="full", ramp=(1, 2, 4, 8, 16, 32, 64), output_len=16, max_short_len=128,
                   max_long_len=1024, max_long_prefill_s=4.0, phase_s=24.0, num_baseline=5, max_requests=128,
                   mixed_concurrency=4, unique_control=True, find_knee=True)
"""Finds the saturation knee: the ramp doubles concurrency until throughput stops rising (3-5 minutes on a
CPU server, which saturates at 8-32 streams; `--max-concurrency` caps it for a production server)."""

RAMP_PREFIX = "probe:ramp-"


def ramp_level(source: str) -> int | None:
    """The concurrency of a probe ramp run from its source name ("probe:ramp-8" -> 8; the baseline, the
    ramp's first point, -> 1); None for any other run."""
    if source == "probe:baseline":
        return 1
    return int(source[len(RAMP_PREFIX):]) if source.startswith(RAMP_PREFIX) else None


KNEE_MIN_GAIN = 1.1
"""A ramp point whose output throughput is under this multiple of the previous point's is past the knee."""
MAX_FAILED_SHARE = 0.1
"""A ramp point with more failed requests than this (HTTP 429s of a full queue, timeouts) ends the ramp."""


@dataclass(frozen=True)
class RampPoint:
    """One measured ramp point: concurrency, output tokens per second, and failed requests' share."""

    concurrency: int
    output_throughput: float
    failed_share: float = 0.0


def knee_reason(points: list[RampPoint]) -> str | None:
    """Why the ramp stops after the last point, or None to go on. Pure: the probe measures, this decides.
    The knee is the last point that still raised throughput by KNEE_MIN_GAIN over the one before."""
    last = points[-1]
    if last.failed_share > MAX_FAILED_SHARE:
        return f"{last.failed_share:.0%} of the requests at {last.concurrency} in flight failed"
    if len(points) < 2 or points[-2].output_throughput <= 0:
        return None
    gain = last.output_throughput / points[-2].output_throughput
    if gain < KNEE_MIN_GAIN:
        return (f"throughput stopped rising: {last.output_throughput:,.1f} tok/s at {last.concurrency} in flight, "
                f"{gain - 1:+.0%} over {points[-2].concurrency}")
    return None

QUICK = ProbeLimits(name="quick", ramp=(1, 8), output_len=8, max_short_len=64, max_long_len=512,
                    max_long_prefill_s=1.5, phase_s=8.0, num_baseline=5, max_requests=24,
                    mixed_concurrency=4, unique_control=False)
"""Under a minute: baseline, long/short, shared prefixes, one ramp point."""


@dataclass(frozen=True)
class Baseline:
    """What the single-request baseline measured (medians over its successful requests).

    Invariant: ``ttft_ms > 0``, ``tpot_ms >= 0``, ``num_prompt_tokens >= 1`` (as the server counted)."""

    ttft_ms: float
    tpot_ms: float
    num_prompt_tokens: int

    @property
    def prefill_ms_per_token(self) -> float:
        """An upper bound: TTFT includes fixed per-request costs, charged here to the prompt."""
        return self.ttft_ms / self.num_prompt_tokens

    def request_s(self, prompt_len: int, output_len: int) -> float:
        """Estimated seconds for one request of these lengths on an otherwise idle server."""
        return (prompt_len * self.prefill_ms_per_token + max(0, output_len - 1) * self.tpot_ms) / 1000.0


@dataclass(frozen=True)
class ProbePhase:
    """One ``run_bench`` call: what to send and why. ``looks_for`` names the rules it feeds."""

    name: str
    looks_for: str
    dataset: DatasetConfig
    load: LoadShape

    def describe(self) -> str:
        d, load = self.dataset, self.load
        lengths = (f"{d.input_len} / {d.long_input_len} tokens ({d.long_fraction:.0%} long)"
                   if d.kind == "long-short" else
                   f"{d.input_len} tokens, {d.prefix_len} shared by {d.num_prefixes} prefix groups"
                   if d.kind == "shared-prefix" else f"{d.input_len} tokens")
        return (f"up to {load.num_requests} requests in {load.duration_s:.0f} s at concurrency "
                f"{load.concurrency}, prompts {lengths}, {d.output_len} output tokens; looks for {self.looks_for}")


def prompt_cap(max_model_len: int | None, output_len: int) -> int:
    """Longest prompt (bench tokens) that fits the context with the output and the tokenizer slack."""
    limit = max_model_len or DEFAULT_MAX_MODEL_LEN
    return max(8, int((limit - output_len - 8) / TOKEN_SLACK))


RAMP_OUTPUT_SPREAD = 0.5
"""The ramp's output lengths spread uniformly over +-50% of the output length (its prompts keep one length): with
outputs of one length a batch finishes together, so a server that starts new requests only when its batch has
finished looks like one that batches continuously (rules/prompt_gap.py). Not where the ramp looks for the
saturation knee (the full probe): the spread's idle tail at the end of a closed loop bends the knee."""


def short_len(limits: ProbeLimits, max_model_len: int | None) -> int:
    """Short prompts: a chat turn, at most an eighth of what fits (so long ones can be 4x+ longer)."""
    return max(8, min(limits.max_short_len, prompt_cap(max_model_len, limits.output_len) // 8))


def baseline_phase(limits: ProbeLimits, max_model_len: int | None) -> ProbePhase:
    """Concurrency 1, a few short requests: batch-1 TTFT and TPOT, and the ramp's first point."""
    # Nothing is known about the server yet: half a phase bounds it (at least one request is sent).
    load = LoadShape(concurrency=1, num_requests=limits.num_baseline, duration_s=0.5 * limits.phase_s)
    return ProbePhase("baseline", "batch-1 TTFT and TPOT (decode-bound with --model/--gpu)",
                      DatasetConfig(kind="random", input_len=short_len(limits, max_model_len),
                                    output_len=limits.output_len, seed=1), load)


def _num_requests(limits: ProbeLimits, concurrency: int, request_s: float, minimum: int) -> int:
    """As many as an ideally batching server finishes in half the phase, within [minimum, cap], in whole rounds of
    `concurrency`: a last round part full leaves slots idle for a whole request's time, which reads as less
    throughput (17 requests 4 at a time take 5 rounds: 15% under the server's rate, enough to move a knee)."""
    fits = int(concurrency * 0.5 * limits.phase_s / max(request_s, 1e-3))
    return max(minimum, min(limits.max_requests, fits) // concurrency * concurrency)


def _closed(limits: ProbeLimits, concurrency: int, num_requests: int, request_s: float) -> LoadShape:
    """Closed loop; sending stops early enough that the requests still in flight at the deadline
    finish near ``phase_s`` even on a server that runs them one after another (never before half
    of ``phase_s``, so a slow server still gets one round of ``concurrency`` requests)."""
    deadline = max(0.5 * limits.phase_s, limits.phase_s - concurrency * request_s)
    return LoadShape(concurrency=concurrency, num_requests=num_requests, duration_s=deadline)


def plan_after_baseline(limits: ProbeLimits, max_model_len: int | None, base: Baseline) -> list[ProbePhase]:
    """The phases after the baseline, sized from what it measured."""
    out = limits.output_len
    short = short_len(limits, max_model_len)
    cap = prompt_cap(max_model_len, out)
    # Long prompts: as long as fits and as the time budget allows, and at least 4x the short ones
    # (the doctor's "long" bar) where the context allows it.
    by_time = int(limits.max_long_prefill_s * 1000.0 / base.prefill_ms_per_token)
    long = min(cap, max(4 * short, min(limits.max_long_len, by_time)))
    mixed = limits.mixed_concurrency
    avg_mixed = 0.75 * base.request_s(short, out) + 0.25 * base.request_s(long, out)
    phases = [ProbePhase(
        "long-short", "prefill-bound, long-short-mixing, prefill-interrupts-decode",
        DatasetConfig(kind="long-short", input_len=short, output_len=out, long_fraction=0.25,
                      long_input_len=long, seed=2),
        _closed(limits, mixed, _num_requests(limits, mixed, avg_mixed, 16), avg_mixed))]
    # Shared prefixes: 3/4 of each prompt shared within a group; the control has the same lengths.
    total = min(cap, 4 * short)
    shared_s = base.request_s(total // 4, out)  # with prefix caching only the suffix is prefilled
    num_shared = _num_requests(limits, mixed, shared_s, 12)
    num_prefixes = 2 if num_shared < 16 else 4
    phases.append(ProbePhase(
        "shared-prefix", "prefix-cache-miss",
        DatasetConfig(kind="shared-prefix", input_len=total, output_len=out, num_prefixes=num_prefixes,
                      num_suffixes=max(2, num_shared // num_prefixes), prefix_len=3 * total // 4, seed=3),
        _closed(limits, mixed, num_shared, shared_s)))
    if limits.unique_control:
        phases.append(ProbePhase(
            "unique-prefix", "the control for shared-prefix: same lengths, nothing to reuse",
            DatasetConfig(kind="random", input_len=total, output_len=out, seed=4),
            _closed(limits, mixed, num_shared, base.request_s(total, out))))
    for concurrency in limits.ramp[1:]:
        ramp_s = base.request_s(short, out)
        num = _num_requests(limits, concurrency, ramp_s, 2 * concurrency)
        phases.append(ProbePhase(
            f"ramp-{concurrency}", "queueing, static-batching, decode-bound (TPOT growth), kv-cache-pressure",
            DatasetConfig(kind="random", input_len=short, output_len=out, len_dist="uniform",
                          output_range_ratio=0.0 if limits.find_knee else RAMP_OUTPUT_SPREAD, seed=10 + concurrency),
            _closed(limits, concurrency, num, ramp_s)))
    return phases
