"""Prompt datasets: random lengths, shared-prefix groups, long/short mix, multi-turn, JSONL, traces.

Every generated prompt's ``num_prompt_tokens`` is its re-encoded length under the given tokenizer
(exact with a model tokenizer; word counts with the fallback).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvpilot.bench.records import Turn, WorkItem
from kvpilot.bench.tokens import Tokenizer, count_tokens, text_of_length

DatasetKind = Literal["random", "shared-prefix", "long-short", "multi-turn", "jsonl", "trace"]
LenDist = Literal["fixed", "uniform", "normal"]
# generated kinds are drawn from `seed`; file kinds are read from `path` as given
GENERATED_KINDS: tuple[str, ...] = ("random", "shared-prefix", "long-short", "multi-turn")
FILE_KINDS: tuple[str, ...] = ("jsonl", "trace")
DATASET_KINDS: tuple[str, ...] = GENERATED_KINDS + FILE_KINDS


class DatasetError(ValueError):
    """Bad dataset options or an unreadable dataset file."""


@dataclass(frozen=True)
class DatasetConfig:
    """How to build prompts. Lengths are tokens; ``range_ratio`` widens uniform/normal lengths (of the output
    alone: ``output_range_ratio``, when set)."""

    kind: DatasetKind = "random"
    input_len: int = 128
    output_len: int = 64
    len_dist: LenDist = "fixed"
    range_ratio: float = 0.0
    output_range_ratio: float | None = None
    num_prefixes: int = 4
    num_suffixes: int = 8
    prefix_len: int = 512
    long_fraction: float = 0.1
    long_input_len: int = 4096
    num_turns: int = 3
    path: str | None = None
    seed: int = 0


def sample_lengths(rng: np.random.Generator, mean: int, dist: LenDist, ratio: float, n: int) -> list[int]:
    """Lengths >= 1: fixed, uniform in [mean(1-r), mean(1+r)], or normal(std=r*mean) clipped there."""
    if dist == "fixed" or ratio <= 0:
        return [max(1, mean)] * n
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n).tolist()
    if dist == "normal":
        return np.clip(np.rint(rng.normal(mean, ratio * mean, size=n)), lo, hi).astype(int).tolist()
    raise DatasetError(f"unknown length distribution '{dist}': use fixed, uniform or normal")


def _turn(tok: Tokenizer, text: str, max_tokens: int) -> Turn:
    return Turn(text=text, num_prompt_tokens=count_tokens(tok, text), max_tokens=max(1, max_tokens))


def random_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    rng = np.random.default_rng(cfg.seed)
    ins = sample_lengths(rng, cfg.input_len, cfg.len_dist, cfg.range_ratio, n)
    spread = cfg.range_ratio if cfg.output_range_ratio is None else cfg.output_range_ratio
    outs = sample_lengths(rng, cfg.output_len, cfg.len_dist, spread, n)
    return [WorkItem(i, (_turn(tok, text_of_length(tok, ins[i], rng), outs[i]),)) for i in range(n)]


def shared_prefix_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    """``num_prefixes`` x ``num_suffixes`` prompts (cycled to n), shuffled; group_id = prefix index."""
    rng = np.random.default_rng(cfg.seed)
    prefixes = [text_of_length(tok, cfg.prefix_len, rng) for _ in range(cfg.num_prefixes)]
    pairs = [(p, s) for p in range(cfg.num_prefixes) for s in range(cfg.num_suffixes)]
    order = [pairs[i % len(pairs)] for i in rng.permutation(max(n, len(pairs)))][:n]
    items = []
    for i, (p, _s) in enumerate(order):
        suffix = text_of_length(tok, max(1, cfg.input_len - cfg.prefix_len), rng)
        items.append(WorkItem(i, (_turn(tok, prefixes[p] + " " + suffix, cfg.output_len),),
                              group_id=f"prefix-{p}"))
    return items


def long_short_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    """Short chat prompts mixed with ``long_fraction`` long documents; group_id "long"/"short"."""
    rng = np.random.default_rng(cfg.seed)
    num_long = int(round(cfg.long_fraction * n))
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.choice(n, size=num_long, replace=False)] = True
    items = []
    for i in range(n):
        length = cfg.long_input_len if is_long[i] else cfg.input_len
        items.append(WorkItem(i, (_turn(tok, text_of_length(tok, length, rng), cfg.output_len),),
                              group_id="long" if is_long[i] else "short"))
    return items


def multi_turn_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    """Sessions of ``num_turns`` user turns each; n counts requests (turns), so ceil(n/turns) sessions."""
    rng = np.random.default_rng(cfg.seed)
    num_sessions = -(-n // max(1, cfg.num_turns))
    items = []
    for s in range(num_sessions):
        turns = tuple(_turn(tok, text_of_length(tok, cfg.input_len, rng), cfg.output_len)
                      for _ in range(cfg.num_turns))
        items.append(WorkItem(s, turns, group_id=f"session-{s}"))
    return items


def _read_jsonl(path: str | None) -> list[dict[str, Any]]:
    if not path:
        raise DatasetError("this dataset needs --dataset-path FILE.jsonl")
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file '{path}': {exc}") from exc
    rows = []
    for num, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{num}: not valid JSON ({exc.msg})") from exc
    if not rows:
        raise DatasetError(f"dataset file '{path}' has no rows")
    return rows


def _row_item(i: int, row: dict[str, Any], cfg: DatasetConfig, tok: Tokenizer,
              rng: np.random.Generator, arrival_s: float | None) -> WorkItem:
    max_tokens = int(row.get("max_tokens") or row.get("output_len") or row.get("output_length")
                     or cfg.output_len)
    group = row.get("group_id")
    if isinstance(row.get("messages"), list):
        msgs = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"])
        text = "\n".join(m["content"] for m in msgs)
        return WorkItem(i, (_turn(tok, text, max_tokens),), group, arrival_s, messages=msgs)
    if "prompt" in row:
        return WorkItem(i, (_turn(tok, str(row["prompt"]), max_tokens),), group, arrival_s)
    length = row.get("input_len") or row.get("input_length")
    if length is None:
        raise DatasetError(f"row {i + 1} needs 'prompt', 'messages' or 'input_len'")
    return WorkItem(i, (_turn(tok, text_of_length(tok, int(length), rng), max_tokens),), group, arrival_s)


def jsonl_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    """Rows ``{"prompt": str}`` or ``{"messages": [...]}``, optional ``max_tokens``/``group_id``."""
    rng = np.random.default_rng(cfg.seed)
    return [_row_item(i, row, cfg, tok, rng, None) for i, row in enumerate(_read_jsonl(cfg.path))]


def trace_dataset(cfg: DatasetConfig, tok: Tokenizer, n: int) -> list[WorkItem]:
    """Rows with ``timestamp`` (s; or ``timestamp_ms``) plus a prompt or ``input_len``/``output_len``.

    Arrivals are replayed relative to the first row's timestamp.
    """
    rng = np.random.default_rng(cfg.seed)
    rows = _read_jsonl(cfg.path)
    try:
        stamps = [float(r["timestamp"]) if "timestamp" in r else float(r["timestamp_ms"]) / 1000.0
                  for r in rows]
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError("every trace row needs a numeric 'timestamp' (s) or 'timestamp_ms'") from exc
    t0 = min(stamps)
    items = [_row_item(i, row, cfg, tok, rng, ts - t0) for i, (row, ts) in enumerate(zip(rows, stamps, strict=True))]
    return sorted(items, key=lambda it: it.arrival_s or 0.0)


_BUILDERS = {"random": random_dataset, "shared-prefix": shared_prefix_dataset,
             "long-short": long_short_dataset, "multi-turn": multi_turn_dataset,
             "jsonl": jsonl_dataset, "trace": trace_dataset}


def build_dataset(cfg: DatasetConfig, tok: Tokenizer, num_requests: int) -> list[WorkItem]:
    """Build work items; generated kinds make ``num_requests`` requests, file kinds use the file."""
    if cfg.kind not in _BUILDERS:
        raise DatasetError(f"unknown dataset '{cfg.kind}': use one of {', '.join(DATASET_KINDS)}")
    if num_requests < 1:
        raise DatasetError("--num-requests must be >= 1")
    return _BUILDERS[cfg.kind](cfg, tok, num_requests)
