"""The cost model that keeps speculation from ever making decoding slower (docs/engine.md, "Speculative
decoding").

A decode step of r rows (each decode is one row; a request verifying k drafts is 1 + k rows) takes
t(r) = fixed + per_row * r seconds near a given batch size: `fixed` is what a step costs whatever its rows
(reading the weights, at small batches), `per_row` what each row adds (its share of the GEMMs' arithmetic,
reading its context in attention, sampling). StepTimeModel fits both online from the engine's own decode
steps, locally: the line that holds around one stream is not the one around 64.

A step of B plain rows makes B tokens in t(B), so one more row's per_row seconds are worth
`price = per_row * B / t(B)` tokens of plain decoding (0 at B = 1 on a weight-bound device, near 1 once
the step is compute-bound). A request's draft j is accepted together with every draft before it with
probability alpha**j (alpha: its acceptance estimate, spec_acceptance.py), so draft j earns alpha**j tokens
and costs `price`: a request gets the drafts that pay, k = #{j in 1..K : alpha**j > price}, and none when
even the first does not. Large batches price rows near 1, so speculation switches itself off there.

A draft model costs more than the verifying row: its own steps, one batched round per draft position (plus
catching up on the tokens the target accepted), which the runner times apart (`draft_seconds`). DraftCost
learns what one round costs each request drafting in it, and the price of a draft adds that share in tokens
of plain decoding: `(round share) * B / t(B)`, t fitted on the target's time only. A draft model as costly as
the target's step prices its drafts at 1 or more, so at one stream it is switched off (it cannot pay); one
ten times cheaper adds ~0.1. n-gram drafts cost no round (their lookup is the scheduler's own, ~us).
"""

from __future__ import annotations

from dataclasses import dataclass

# t(r) = fixed * (1 + PRIOR_ROW_FRACTION * r) until the steps say otherwise (a row as 1/8 of a weight read:
# off from about 8 rows for a typical acceptance, so a cold start at high load stays off). The prior pulls
# per_row towards this share of `fixed` with PRIOR_WEIGHT pseudo-observations: it decides only what the data
# cannot (every step with the same number of rows leaves per_row against fixed undetermined).
PRIOR_ROW_FRACTION = 1 / 8
PRIOR_WEIGHT = 1.0
STEP_MEMORY = 0.99  # each step's weight decays by this per later step (~100 steps remembered): context grows
NUM_BUCKETS = 16  # log2 buckets of a step's rows (StepTimeModel): 1, 2-3, 4-7, ..., 32768+
NEIGHBOUR_WEIGHT = 0.25  # a bucket's steps count 4x less per bucket away from the batch being priced
# At or above this price no request is even considered (a draft would net at most 1 - price tokens): a large
# batch pays no per-request host work for speculation it would not get.
PRICE_CUTOFF = 0.9
DRAFT_MEMORY = 0.9  # a draft model's round cost: each step's weight decays by this per later step with drafts


def draft_price(fixed: float, per_row: float, num_rows: int) -> float:
    """The tokens of plain decoding one extra row costs in a step of num_rows plain rows (module docstring),
    in [0, 1]; 1 (never worth it) when the fit is degenerate (no fixed cost)."""
    rows = max(num_rows, 1)
    if fixed <= 0:
        return 1.0
    per_row = max(per_row, 0.0)
    return per_row * rows / (fixed + per_row * rows)


def draft_model_price(fixed: float, per_row: float, num_rows: int, round_share: float) -> float:
    """draft_price plus a draft model's round share (seconds of its steps per request per draft) in tokens of
    plain decoding at num_rows rows: round_share / (t(B) / B)."""
    rows = max(num_rows, 1)
    step = fixed + max(per_row, 0.0) * rows
    extra = round_share * rows / step if step > 0 and round_share > 0 else 0.0
    return draft_price(fixed, per_row, num_rows) + extra


class DraftCost:
    """Seconds of draft-model work per request per draft position, as a decayed mean over steps with drafts
    (DRAFT_MEMORY); 0 until one was seen, and for proposers that run nothing (n-gram)."""

    def __init__(self) -> None:
        self.round_share = 0.0
        self._weight = 0.0

    def observe(self, draft_seconds: float, num_rounds: int, num_requests: int) -> None:
        """A step whose drafts took draft_seconds: num_rounds draft positions (its longest drafts), each a round
        over num_requests requests."""
        if draft_seconds <= 0 or num_rounds < 1 or num_requests < 1:
            return
        share = draft_seconds / (num_rounds * num_requests)
        self._weight = DRAFT_MEMORY * self._weight + 1.0
        self.round_share += (share - self.round_share) / self._weight


def num_worthwhile_drafts(alpha: float, price: float, max_drafts: int) -> int:
    """k = #{j in 1..max_drafts : alpha**j > price}: the drafts whose expected accepted tokens beat the rows
    they take. alpha**j only falls with j, so these are always the first k."""
    k, accepted = 0, alpha
    while k < max_drafts and accepted > price:
        k += 1
        accepted *= alpha
    return k


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Tokens a verification of num_drafts drafts emits on average: 1 + alpha + ... + alpha**num_drafts (the
    target's own token always, plus each draft accepted with all before it)."""
    return sum(alpha ** j for j in range(num_drafts + 1))


@dataclass
class StepSums:
    """Decayed sums over observed steps (rows r, seconds t) for least squares of relative residuals (step times
    are noisy in proportion to their length): sum(u), sum(u r), sum(u r^2), sum(u t), sum(u r t) with u = w /
    t^2, each step's w decaying by STEP_MEMORY per later step added here."""

    s0: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    sy: float = 0.0
    sry: float = 0.0

    def add(self, rows: float, seconds: float) -> None:
        d, u = STEP_MEMORY, 1.0 / max(seconds, 1e-9) ** 2
        self.s0, self.s1, self.s2 = d * self.s0 + u, d * self.s1 + u * rows, d * self.s2 + u * rows * rows
        self.sy, self.sry = d * self.sy + u * seconds, d * self.sry + u * rows * seconds


def bucket_of(num_rows: int) -> int:
    """The log2 bucket of a step's rows: 1 -> 0, 2-3 -> 1, 4-7 -> 2, ..."""
    return min(max(num_rows, 1).bit_length() - 1, NUM_BUCKETS - 1)


class StepTimeModel:
    """fixed + per_row * r, fitted by least squares near the batch being priced, regularised towards per_row =
    PRIOR_ROW_FRACTION * fixed (so steps of one size only still give a well-posed 2x2 solve).

    A row's marginal cost grows with the batch (memory-bound at a few rows, compute-bound at many, with steps
    where kernels change), so one line through every step would carry one stream's cheap rows into a large
    batch's price. Steps are kept in log2 buckets of their rows (StepSums, O(1) an update), and a fit for B
    rows weighs bucket i by NEIGHBOUR_WEIGHT ** |i - bucket_of(B)|: the batch's own neighbourhood decides,
    sizes further off still give the slope where the neighbourhood has one size only."""

    def __init__(self) -> None:
        self.buckets = [StepSums() for _ in range(NUM_BUCKETS)]

    def observe(self, num_rows: int, seconds: float) -> None:
        """One decode-only step (plain decodes and verifications; no prompt tokens) of num_rows rows."""
        self.buckets[bucket_of(num_rows)].add(float(num_rows), seconds)

    def fit(self, num_rows: int = 1) -> tuple[float, float]:
        """(fixed, per_row) in seconds around num_rows; before any step (1, PRIOR_ROW_FRACTION): the prior's
        proportions."""
        home = bucket_of(num_rows)
        s0 = s1 = s2 = sy = sry = 0.0
        for i, sums in enumerate(self.buckets):
            if sums.s0:
                w = NEIGHBOUR_WEIGHT ** abs(i - home)
                s0, s1, s2 = s0 + w * sums.s0, s1 + w * sums.s1, s2 + w * sums.s2
                sy, sry = sy + w * sums.sy, sry + w * sums.sry
        if s0 == 0:
            return 1.0, PRIOR_ROW_FRACTION
        # minimise sum u (t - a - b r)^2 + PRIOR_WEIGHT ((b - f a) / t_mean)^2 over (a, b): residuals relative
        # to each step's time, the prior's to the neighbourhood's mean step time (sy / s0)
        f, p = PRIOR_ROW_FRACTION, PRIOR_WEIGHT * (s0 / sy) ** 2
        m00, m01, m11 = s0 + p * f * f, s1 - p * f, s2 + p
        det = m00 * m11 - m01 * m01
        if det <= 0:
            return 1.0, PRIOR_ROW_FRACTION
        return (sy * m11 - m01 * sry) / det, (m00 * sry - m01 * sy) / det

    def price(self, num_rows: int, round_share: float = 0.0) -> float:
        """A draft row's price at num_rows rows; round_share: a draft model's work per draft (DraftCost)."""
        fixed, per_row = self.fit(num_rows)
        return draft_model_price(fixed, per_row, num_rows, round_share)
