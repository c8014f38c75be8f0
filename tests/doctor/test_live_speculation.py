"""The speculation rules on the real kvpilot server and real bench output: answers that repeat a passage are
measured as copies by the client (bench's copy counts) and prompt-copying names them while speculation is off;
with n-gram speculation on, the requests carry the server's `speculation` counts and the rule is quiet. Chat
questions are the control: their answers copy little."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.bench.api import BenchConfig
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.doctor.thresholds import Thresholds
from tests.doctor.bench_worker import BenchWorker
from tests.doctor.live_staging import MODEL, kvpilot_server

pytestmark = pytest.mark.slow

# Public domain: Abraham Lincoln, the Gettysburg Address (1863); Charles Dickens, A Tale of Two Cities (1859).
PASSAGES = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil "
    "war, testing whether that nation, or any nation so conceived and so dedicated, can long endure.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair.")
# Two requests a run keep the test cheap; the rules' statistics floor (5 by default) is relaxed to match.
THRESHOLDS = Thresholds(min_requests=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def worker() -> Iterator[BenchWorker]:
    with BenchWorker() as w:
        yield w


def _chat_dataset(path: Path, questions: list[str]) -> DatasetConfig:
    rows = [{"messages": [{"role": "user", "content": q}], "max_tokens": 16} for q in questions]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return DatasetConfig(kind="jsonl", path=str(path))


def _bench(worker: BenchWorker, url: str, dataset: DatasetConfig, label: str) -> tuple[dict[str, Any], str]:
    cfg = BenchConfig(Target(url, MODEL, endpoint="chat", ignore_eos=True, timeout_s=120.0, temperature=0.0),
                      dataset=dataset, load=LoadShape(concurrency=1, num_requests=2),
                      scrape_interval_s=0.5, progress=False)
    return worker.run(cfg), label


def _records(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for run in doc["runs"] for r in run["requests"] if r["ok"]]


def _share(doc: dict[str, Any]) -> float:
    recs = _records(doc)
    return sum(r["num_copied_words"] for r in recs) / sum(r["num_output_words"] for r in recs)


def _rule_ids(*measured: tuple[dict[str, Any], str]) -> list[str]:
    return [f.rule_id for f in diagnose(inputs_from_documents(list(measured)), THRESHOLDS).findings]


def _without_speculation(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as a server without speculation would have answered: greedy speculation is token-exact
    (tests/engine_e2e), so only the server's `speculation` counts differ."""
    out = copy.deepcopy(doc)
    for r in _records(out):
        r["server"].update(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
    return out


def test_copying_answers_are_measured_and_named(llm_fp32, worker: BenchWorker, tmp_path: Path) -> None:
    """One server (n-gram on), so the test starts one engine: the copy runs' records carry its drafts and the
    rule is quiet; the same answers without them (speculation off) are named."""
    with kvpilot_server(llm_fp32.loaded, speculative_config=NGRAM) as server:
        # the embedded 135M model copies on this wording (it paraphrases on "Repeat the following passage")
        copy_tasks = _chat_dataset(tmp_path / "copy.jsonl", [f"Copy this text exactly:\n\n{t}" for t in PASSAGES])
        copied = _bench(worker, server.url, copy_tasks, "copy, n-gram speculation")
        questions = _chat_dataset(tmp_path / "chat.jsonl", ["Write a short poem about the sea.",
                                                            "What should I cook for dinner tonight?"])
        control = _bench(worker, server.url, questions, "chat questions")
    assert _share(copied[0]) >= 0.5, _records(copied[0])
    assert _share(control[0]) < 0.2
    drafts = [r["server"]["num_drafts"] for r in _records(copied[0])]
    assert all(n > 0 for n in drafts), drafts  # each request's `speculation` field reached its record
    assert "prompt-copying" not in _rule_ids(copied)  # already on
    assert "prompt-copying" in _rule_ids((_without_speculation(copied[0]), "copy, speculation off"))
    assert "prompt-copying" not in _rule_ids((_without_speculation(control[0]), "chat, speculation off"))
