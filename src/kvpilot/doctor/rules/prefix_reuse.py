"""How much prompt-prefix reuse the measured traffic offered, how much the server's cache gave, and whether a
full KV pool is why the rest was lost (cached prefix blocks evicted before their group came back).

Shared by ``prefix-cache-miss`` (the symptom) and ``kv-cache-pressure`` (the cause, when the pool is full): a
prefix miss that the full pool itself causes defers to the pool, whose fixes (more KV memory, KV offload) are
the ones that bring the hits back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.doctor.findings import Evidence
from kvpilot.doctor.inputs import RunData
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.signals import first_token_s


def expected_hit_rate(run: RunData) -> float | None:
    """Share of prompt tokens a perfect prefix cache could have served in a run of bench's
    shared-prefix dataset: the prefix share of each prompt, for every request sent after another
    request of its prefix group had its first token (that prefix was computed and cached by then).
    Requests sent before that (a closed loop's first round sends several of a group at once) cannot
    reuse it in any engine: blocks are shared once computed, not while being prefilled. Without the
    timing, a probe whose one round was all concurrent would "expect" hits no server can give."""
    dataset, ok = run.dataset, run.ok
    if dataset.get("kind") != "shared-prefix" or not ok:
        return None
    prefix, total = float(dataset.get("prefix_len") or 0), float(dataset.get("input_len") or 0)
    if total <= 0:
        return None
    cached_at: dict[str, float] = {}
    for r in ok:
        t = first_token_s(r)
        if r.group_id is not None and t is not None:
            cached_at[r.group_id] = min(t, cached_at.get(r.group_id, math.inf))
    reusable = sum(1 for r in ok if r.group_id in cached_at and r.sent_s >= cached_at[r.group_id])
    return (min(prefix, total) / total) * reusable / len(ok)


def shared_groups(ctx: RuleContext) -> int:
    """Prefix groups (group_id ``prefix-*``) with more than one request."""
    counts: dict[str, int] = {}
    for r in ctx.inputs.ok_records:
        if r.group_id and r.group_id.startswith("prefix"):
            counts[r.group_id] = counts.get(r.group_id, 0) + 1
    return sum(1 for n in counts.values() if n > 1)


@dataclass(frozen=True)
class PrefixReuse:
    """``expected``: the achievable hit rate (None: groups seen, no shared-prefix run to size it); ``bar`` the
    rate judged against; ``hit`` the measured one (None: not reported); ``disabled``: the server says prefix
    caching is off; ``num_groups``: prefix groups with repeats; ``prefix_tokens``: the shared prefix of one group
    (0: unknown)."""

    expected: float | None
    bar: float
    hit: float | None
    disabled: bool
    num_groups: int
    prefix_tokens: int

    @property
    def lost(self) -> float:
        return (self.expected if self.expected is not None else self.bar) - (self.hit or 0.0)


def prefix_shortfall(ctx: RuleContext) -> PrefixReuse | None:
    """The traffic repeated prefixes worth at least ``min_expected_hit_rate`` and the cache gave under
    ``prefix_hit_share_of_expected`` of that (or caching is off); None otherwise."""
    th, view = ctx.th, ctx.view
    expected = max((e for run in ctx.inputs.runs if (e := expected_hit_rate(run)) is not None), default=None)
    groups = shared_groups(ctx)
    if expected is None and groups == 0:
        return None
    bar = expected if expected is not None else th.min_expected_hit_rate / th.prefix_hit_share_of_expected
    if bar < th.min_expected_hit_rate:
        return None
    hit, disabled = view.prefix_hit_rate, view.prefix_caching_enabled is False
    if not disabled and (hit is None or hit >= th.prefix_hit_share_of_expected * bar):
        return None
    prefix = max((int(run.dataset.get("prefix_len") or 0) for run in ctx.inputs.runs
                  if run.dataset.get("kind") == "shared-prefix"), default=0)
    return PrefixReuse(expected, bar, hit, disabled, groups, prefix)


def evicted_by_full_pool(ctx: RuleContext, reuse: PrefixReuse | None) -> tuple[Evidence, ...]:
    """Evidence that a full KV pool evicted the lost prefixes (empty: it did not, or caching is off). The pool
    was full when its usage peaked at ``kv_usage_warn`` or more, or requests were preempted: a pool with that
    little free room hands the least recently used cached blocks, the prefixes of groups not seen for a moment,
    to new requests before their group returns. With the pool's size known, the room left at the peak is set
    against the groups' prefixes."""
    if reuse is None or reuse.disabled:
        return ()
    view, th = ctx.view, ctx.th
    usage, preempt = view.kv_usage_max, view.num_preemptions or 0.0
    if not ((usage is not None and usage >= th.kv_usage_warn) or preempt > 0):
        return ()
    out = [Evidence("measured prefix-cache hit rate", reuse.hit or 0.0, "%", view.source)]
    if reuse.expected is not None:
        out.append(Evidence("achievable hit rate", reuse.expected, "%"))
    cfg = ctx.inputs.server_config
    pool = cfg.num_kv_tokens if cfg is not None else None
    if pool and usage is not None:
        out.append(Evidence("KV tokens free or cached at the peak", (1.0 - usage) * pool, "", cfg.source))
    if reuse.prefix_tokens and reuse.num_groups:
        out.append(Evidence("shared prefix tokens to keep (groups x prefix)", reuse.num_groups * reuse.prefix_tokens))
    snap = ctx.inputs.metrics
    cached = snap.get("kv_blocks_cached") if snap is not None else None
    if cached is not None:
        out.append(Evidence("cached (evictable) blocks after the load", cached, "", "kvpilot:kv_cache_blocks"))
    return tuple(out)
