"""benchmarks/server_overhead.py's argument paths and pure helpers, stopped before any model is loaded."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import server_overhead
from stream_client import ClientRun


class Loaded(Exception):
    """Raised by the stand-in for load_offline: main() got as far as loading, with these arguments."""

    def __init__(self, args):
        super().__init__("stopped before loading the model")
        self.parsed = args


def parsed(monkeypatch, *argv: str):
    """main()'s arguments after its own defaults are applied, and what it printed before loading."""
    monkeypatch.setattr(sys, "argv", ["server_overhead.py", *argv])

    def stop(args):
        raise Loaded(args)

    monkeypatch.setattr(server_overhead, "load_offline", stop)
    with pytest.raises(Loaded) as stopped:
        server_overhead.main()
    return stopped.value.parsed


def test_defaults_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parsed(monkeypatch)
    assert (args.num_requests, args.concurrency, args.input_len, args.output_len, args.rounds) == (64, 32, 128, 64, 3)
    assert (args.kv_cache_memory, args.client, args.model, args.dtype) == ("1GiB", "wire", None, "auto")
    assert args.max_num_batched_tokens == 2048  # the server's CPU default
    assert "64 requests, 32 concurrent, 128 in / 64 out" in capsys.readouterr().out


def test_the_step_budget_is_never_below_the_concurrency(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parsed(monkeypatch, "--concurrency", "4096").max_num_batched_tokens == 4096
    assert parsed(monkeypatch, "--max-num-batched-tokens", "512").max_num_batched_tokens == 512


def test_an_empty_kv_cache_memory_on_a_gpu_means_one_round(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(server_overhead, "default_max_num_batched_tokens", lambda device, seqs, usage: 8192)
    args = parsed(monkeypatch, "--kv-cache-memory", "", "--rounds", "3")
    assert (args.kv_cache_memory, args.rounds, args.max_num_batched_tokens) == (None, 1, 8192)
    assert "--rounds 3: one round" in capsys.readouterr().out
    kept = parsed(monkeypatch, "--kv-cache-memory", "8GiB", "--rounds", "3")
    assert (kept.kv_cache_memory, kept.rounds) == ("8GiB", 3)


def test_client_choices(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parsed(monkeypatch, "--client", "bench", "--client-processes", "4", "--client-poll-ms", "0")
    assert (args.client, args.client_processes, args.client_poll_ms) == ("bench", 4, 0.0)
    monkeypatch.setattr(sys, "argv", ["server_overhead.py", "--client", "curl"])
    with pytest.raises(SystemExit):
        server_overhead.main()
    assert "invalid choice: 'curl'" in capsys.readouterr().err


def test_prompts_share_no_first_token_within_or_across_rounds():
    rounds = [server_overhead.make_prompts(16, 32, seed, vocab=49152) for seed in range(3)]
    assert all(len(p) == 32 for prompts in rounds for p in prompts)
    firsts = [p[0] for prompts in rounds for p in prompts]
    assert len(set(firsts)) == len(firsts)
    assert all(1000 <= t < 49152 for prompts in rounds for p in prompts for t in p[1:])
    assert server_overhead.make_prompts(16, 32, 1, vocab=49152) == rounds[1]  # the same seed, the same round


def test_vocab_size_of_each_model_source(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vocab_size": 1234}))
    vocab = server_overhead._vocab_size
    assert vocab(type("A", (), {"model": None})) == 49152  # the embedded model
    assert vocab(type("A", (), {"model": str(config)})) == 1234
    assert vocab(type("A", (), {"model": "qwen3-0.6b"})) == 151936


def test_preemptions_of_this_process_are_counted():
    assert server_overhead.preemptions(os.getpid()) >= 0
    assert server_overhead.preemptions(2**22 + 12345) == 0  # no such process: nothing under /proc


def test_round_and_summary_lines(capsys):
    args = type("A", (), {"num_requests": 4, "output_len": 10, "client": "wire", "client_processes": 1})
    served = ClientRun(seconds=2.0, num_tokens=40, num_chunks=20, cpu_seconds=0.5, http_cpu_seconds=0.4,
                       core_cpu_seconds=1.5, num_steps=12, core_preemptions=3)
    server_overhead._print_round(args, 0, (1.0, 0.9, 10, 2), served)
    server_overhead._print_summary(args, [((1.0, 0.9, 10, 2), served), ((1.0, 0.9, 10, 2), served)])
    out = capsys.readouterr().out
    assert "round 1: offline    40.0 tok/s" in out and "served    20.0 tok/s" in out and "50.0%" in out
    assert "20 chunks for 40 tokens (2.00 a chunk)" in out and "engine steps: offline 10, served 12" in out
    assert "server / offline     :    50.0%" in out and "median of 2" in out
