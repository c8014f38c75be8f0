"""Datasets: token-exact lengths, groups, mixes, sessions, files and traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvpilot.bench.datasets import DatasetConfig, DatasetError, build_dataset, sample_lengths
from kvpilot.bench.tokens import Tokenizer, WordTokenizer, load_tokenizer

FALLBACK = WordTokenizer()


@pytest.mark.slow
def test_random_prompts_are_token_exact_with_the_model_tokenizer(embedded_tok: Tokenizer) -> None:
    items = build_dataset(DatasetConfig(input_len=100, output_len=7, len_dist="uniform", range_ratio=0.5),
                          embedded_tok, 30)
    lengths = [it.turns[0].num_prompt_tokens for it in items]
    assert all(len(embedded_tok.encode(it.turns[0].text)) == it.turns[0].num_prompt_tokens for it in items)
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 5


def test_output_lengths_alone_can_spread() -> None:
    """``output_range_ratio``: outputs spread, prompts keep one length (the doctor's ramp)."""
    items = build_dataset(DatasetConfig(input_len=20, output_len=8, len_dist="uniform", output_range_ratio=0.5),
                          FALLBACK, 40)
    assert {it.turns[0].num_prompt_tokens for it in items} == {20}
    outs = [it.turns[0].max_tokens for it in items]
    assert min(outs) >= 4 and max(outs) <= 12 and len(set(outs)) > 4


@pytest.mark.slow
def test_shared_prefix_groups_share_their_prefix_tokens(embedded_tok: Tokenizer) -> None:
    cfg = DatasetConfig(kind="shared-prefix", input_len=80, prefix_len=64, num_prefixes=3, num_suffixes=4)
    items = build_dataset(cfg, embedded_tok, 12)
    groups = {it.group_id for it in items}
    assert groups == {"prefix-0", "prefix-1", "prefix-2"}
    for g in groups:
        heads = {tuple(embedded_tok.encode(it.turns[0].text)[:64]) for it in items if it.group_id == g}
        assert len(heads) == 1  # every prompt of a group starts with the same 64 tokens


def test_fallback_tokenizer_lengths_are_exact_in_words() -> None:
    items = build_dataset(DatasetConfig(input_len=33), FALLBACK, 5)
    assert all(len(it.turns[0].text.split()) == 33 == it.turns[0].num_prompt_tokens for it in items)
    assert load_tokenizer(None).name == "fallback-words"


def test_sample_lengths_bounds() -> None:
    rng = np.random.default_rng(0)
    normal = sample_lengths(rng, 100, "normal", 0.2, 500)
    assert min(normal) >= 80 and max(normal) <= 120 and 95 < np.mean(normal) < 105
    assert sample_lengths(rng, 100, "fixed", 0.5, 3) == [100, 100, 100]


def test_long_short_mix() -> None:
    cfg = DatasetConfig(kind="long-short", input_len=8, long_input_len=200, long_fraction=0.1)
    items = build_dataset(cfg, FALLBACK, 50)
    longs = [it for it in items if it.group_id == "long"]
    assert len(longs) == 5 and all(it.turns[0].num_prompt_tokens == 200 for it in longs)
    assert all(it.turns[0].num_prompt_tokens == 8 for it in items if it.group_id == "short")


def test_multi_turn_sessions() -> None:
    items = build_dataset(DatasetConfig(kind="multi-turn", num_turns=3, input_len=5), FALLBACK, 7)
    assert len(items) == 3 and all(len(it.turns) == 3 for it in items)


def test_jsonl_and_trace_files(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 3},
            {"messages": [{"role": "user", "content": "hi"}], "group_id": "g"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = build_dataset(DatasetConfig(kind="jsonl", path=str(path), output_len=9), FALLBACK, 1)
    assert [it.turns[0].max_tokens for it in items] == [3, 9]
    assert items[1].messages == ({"role": "user", "content": "hi"},) and items[1].group_id == "g"
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp_ms": 5500, "input_len": 4, "output_len": 2},
        {"timestamp_ms": 5000, "prompt": "a b c"}]))
    items = build_dataset(DatasetConfig(kind="trace", path=str(trace)), FALLBACK, 1)
    assert [it.arrival_s for it in items] == [0.0, 0.5]
    assert items[1].turns[0].num_prompt_tokens == 4 and items[1].turns[0].max_tokens == 2


def test_dataset_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="--dataset-path"):
        build_dataset(DatasetConfig(kind="jsonl"), FALLBACK, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        build_dataset(DatasetConfig(kind="jsonl", path=str(bad)), FALLBACK, 1)
    with pytest.raises(DatasetError, match="timestamp"):
        bad.write_text('{"prompt": "x"}\n')
        build_dataset(DatasetConfig(kind="trace", path=str(bad)), FALLBACK, 1)
