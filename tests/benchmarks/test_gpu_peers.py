"""benchmarks/gpu_peers.py: the harness end to end on CPU with kvpilot as its own peer (two real engine
processes on one random-weight directory), and its parts: prompts, pass order and the rules that drop a pass,
nano-vllm's source export, the one-rank process group nano-vllm's child joins without NCCL."""

from __future__ import annotations

import json
import subprocess

import pytest

import gpu_peers
from gpu_peers import (CHECK_TOKENS, FULL_ROWS, SMOKE_ROWS, PassResult, make_requests, pass_sequence, summarize,
                       warmup_requests)
from peers import nano_vllm


def test_smoke_runs_two_engine_processes_on_cpu(tmp_path, capsys):
    """kvpilot against itself: both load the written directory, agree token for token, and every pass counts."""
    output = tmp_path / "peers.json"
    gpu_peers.main(["--smoke", "--peer", "kvpilot", "--passes", "1", "--output", str(output)])
    document = json.loads(output.read_text())
    assert document["environment"]["peer"] == "kvpilot" and document["environment"]["smoke"]
    assert [r["row"] for r in document["results"]] == [r.key for r in SMOKE_ROWS]
    for result in document["results"]:
        assert result["greedy_agreement"] == CHECK_TOKENS  # the same engine on the same weights
        assert result["kvpilot_median"] > 0 and result["peer_median"] > 0 and result["ratio_median"] > 0
        assert result["dropped"] == []
    assert "kvpilot-b" in capsys.readouterr().out


def test_prompts_follow_nano_vllms_bench_and_warm_ups_differ():
    row = FULL_ROWS[0]
    requests = make_requests(row, vocab_size=151_936, seed=0)
    assert len(requests) == 256 and requests == make_requests(row, 151_936, 0)
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 and max(p) <= 10_000 for p, n in requests)
    warm = warmup_requests(row, 151_936, 0)
    assert len(warm) == 32 and not {tuple(p) for p, _ in warm} & {tuple(p) for p, _ in requests}
    assert max(n for _, n in warm) <= 256  # a quarter of the row's longest output
    assert all(max(p) < 512 for p, _ in make_requests(SMOKE_ROWS[0], vocab_size=512, seed=3))


def test_every_peer_pass_has_kvpilot_on_both_sides():
    assert pass_sequence("nano-vllm", 3) == ["kvpilot", "nano-vllm"] * 3 + ["kvpilot"]


def _passes(tok_s: list[float], short: dict[int, int] | None = None) -> list[PassResult]:
    short = short or {}
    return [PassResult("r", label, i, int(t), 1.0, short.get(i, 0))
            for i, (label, t) in enumerate(zip(pass_sequence("peer", 3), tok_s))]


def test_ratios_are_per_pass_against_the_kvpilot_neighbours():
    summary = summarize(SMOKE_ROWS[0], _passes([100, 50, 110, 50, 120, 60, 130]), "peer")
    assert summary["kvpilot_median"] == 115 and summary["peer_median"] == 50
    assert summary["ratio_median"] == pytest.approx(105 / 50)  # the median of 105/50, 115/50, 125/60
    assert summary["dropped"] == []


def test_a_pass_with_short_requests_is_dropped_and_named():
    summary = summarize(SMOKE_ROWS[0], _passes([100, 50, 110, 50, 120, 60, 130], short={3: 2}), "peer")
    assert any("pass 3 peer" in d and "6 of 8 requests ok" in d for d in summary["dropped"])
    assert summary["ratio_median"] is None  # two valid peer passes of the three required
    assert summary["ratio"].startswith("no figure: 2 valid")


def _git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_source_export_takes_the_pinned_commit_and_refuses_other_folders(tmp_path):
    clone = tmp_path / "clone"
    (clone / "nanovllm").mkdir(parents=True)
    (clone / "nanovllm" / "llm.py").write_text("first\n")
    _git(clone, "init", "-q")
    _git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    _git(clone, "add", ".")
    _git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "source")
    pinned = _git(clone, "rev-parse", "HEAD")
    (clone / "nanovllm" / "llm.py").write_text("later\n")
    _git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "later")
    exported = nano_vllm.export_source(clone / ".git", tmp_path / "out", commit=pinned)
    assert (exported / "nanovllm" / "llm.py").read_text() == "first\n"
    assert nano_vllm.source_commit(exported) == pinned
    with pytest.raises(FileNotFoundError, match="--export-source"):
        nano_vllm.source_commit(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a git repository"):
        nano_vllm.export_source(tmp_path / "nothing", tmp_path / "out2")


def test_one_rank_joins_over_gloo_where_nano_vllm_asks_for_nccl(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", dist.init_process_group)  # restored after the test
    nano_vllm._one_rank_without_nccl()
    dist.init_process_group("nccl", "tcp://localhost:2333", world_size=1, rank=0)
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
