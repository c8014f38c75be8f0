"""Speculative decoding with a draft model (speculative_config method "draft_model") on tiny random-weight Llama
checkpoints in float32: greedy output is token for token HF transformers' (and plain decoding's) under
continuous batching and preemption, whether the draft is the target itself (every draft accepted) or another
random model (few accepted); the draft's cache rolls back to what the target accepted; seeded sampled requests
give plain decoding's tokens; a draft of another vocabulary is refused at start."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.engine.config import EngineConfigError
from kvpilot.engine.request import Request
from kvpilot.launch.draft_model import check_draft_matches
from tests.engine_e2e.conftest import assert_no_leak
from tests.model.hf_match import prompt_ids, save_random_hf_model
from tests.model.test_architectures import _small_config

pytestmark = pytest.mark.slow

CFG = _small_config("llama-3.2-1b")
VOCAB = CFG["vocab_size"]
PROMPTS = prompt_ids([1, 9, 20, 31, 47], VOCAB)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target (with HF's greedy decoder), a 1-layer random draft of the same vocabulary, and one of half
    the vocabulary: paths."""
    root = tmp_path_factory.mktemp("draft_models")
    hf = save_random_hf_model(CFG, root / "target")
    save_random_hf_model({**CFG, "num_hidden_layers": 1, "hidden_size": 32, "head_dim": 8}, root / "draft")
    save_random_hf_model({**CFG, "vocab_size": VOCAB // 2}, root / "small_vocab")
    return SimpleNamespace(hf=hf, target=str(root / "target"), draft=str(root / "draft"),
                           small_vocab=str(root / "small_vocab"))


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return LLM(model=models.target, dtype="float32", kv_cache_memory="4MiB", max_model_len=256)


def _spec_llm(plain: LLM, draft: str, kv_cache_memory: str = "4MiB", num_drafts: int = 4,
              max_model_len: int = 256) -> LLM:
    """The target's weights with a draft model; draft rows priced at nothing, so every decode verifies drafts
    (the cost model would switch some off on a busy CPU)."""
    llm = LLM(loaded=plain.loaded, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
              enable_prefix_caching=False,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": num_drafts})
    llm.engine.scheduler.speculator.step_price = lambda num_running: 0.0
    return llm


def _assert_no_leak(llm: LLM) -> None:
    """conftest.assert_no_leak, and the draft's cache empty too: every finished request was forgotten."""
    assert_no_leak(llm)
    proposer = llm.engine.scheduler.speculator.proposer
    assert proposer.num_requests == 0 and proposer.num_free_blocks == proposer.runner.num_blocks


def _acceptance(outputs) -> float:
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    assert drafted > 0
    return sum(o.metrics.num_accepted_tokens for o in outputs) / drafted


def test_a_draft_equal_to_the_target_is_exact_and_accepts_every_draft(models, plain):
    want = [models.hf(p, 24) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)] == want
    llm = _spec_llm(plain, models.target)  # {"model": PATH} alone: vLLM's draft_model too
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert _acceptance(outputs) >= 0.95
    _assert_no_leak(llm)


def test_a_different_draft_is_still_exact(models, plain):
    llm = _spec_llm(plain, models.draft)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [models.hf(p, 24) for p in PROMPTS]
    assert _acceptance(outputs) < 0.5  # random weights: the draft mostly guesses wrong, the target corrects
    _assert_no_leak(llm)


def test_preemption_under_kv_pressure(models, plain):
    # 512 B a token a model; 80 KiB split evenly: 80 tokens each, the 5 requests need 228 at once
    llm = _spec_llm(plain, models.target, kv_cache_memory="80KiB", num_drafts=3, max_model_len=80)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [models.hf(p, 24) for p in PROMPTS]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert _acceptance(outputs) >= 0.95
    _assert_no_leak(llm)


def test_seeded_sampled_requests_give_plain_decodings_tokens(models, plain):
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=20, ignore_eos=True)
              for t, p, s in ((0.8, 0.95, 1), (0.3, 1.0, 2), (1.0, 0.9, 3))]
    want = [plain.generate([PROMPTS[i]], params[i])[0].outputs[0].token_ids for i in range(3)]
    llm = _spec_llm(plain, models.target)
    outputs = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    _assert_no_leak(llm)


def _drafts(proposer, requests: list[Request], num_drafts: int) -> list[list[int]]:
    """What a step does: the scheduler's propose() per request (placeholders), then the runner's fill()."""
    placeholders = {r.request_id: proposer.propose(r, num_drafts) for r in requests}
    proposer.fill(placeholders)
    return [placeholders[r.request_id] for r in requests]


def test_the_drafts_cache_rolls_back_to_what_the_target_accepted(models, plain):
    """Driven directly, two requests drafted together, catch-ups in rounds of 8 tokens: after a partly
    rejected round, the next drafts are still the draft's (here: the target's) greedy continuation of each
    request's tokens, so the K/V of rejected drafts was not kept."""
    llm = _spec_llm(plain, models.target)
    proposer = llm.engine.scheduler.speculator.proposer
    proposer.max_chunk_tokens = 8
    requests = [Request(f"r{i}", list(PROMPTS[i]), GREEDY, arrival_time=0.0) for i in (2, 3)]
    first = _drafts(proposer, requests, 4)
    assert first == [models.hf(r.all_token_ids, 4) for r in requests]
    # the target "accepts" one draft and emits a token other than the second draft, then two plain decodes (no
    # drafts asked for): positions the rejected drafts' K/V took are now behind the request's last token
    for request, drafts in zip(requests, first):
        for token in (drafts[0], (drafts[1] + 1) % VOCAB, 7, 8):
            request.append_output_token(token, time.monotonic())
    assert _drafts(proposer, requests, 3) == [models.hf(r.all_token_ids, 3) for r in requests]
    assert proposer.num_requests == 2
    for request in requests:
        proposer.forget(request.request_id)
    assert proposer.num_requests == 0 and proposer.num_free_blocks == proposer.runner.num_blocks
    # a draft step that raises (a token id past the embedding) leaves placeholders, which verification rejects
    assert _drafts(proposer, [Request("bad", [1, 10 * VOCAB], GREEDY, arrival_time=0.0)], 2) == [[0, 0]]
    assert proposer.num_requests == 0
    assert _drafts(proposer, requests[:1], 3) == [models.hf(requests[0].all_token_ids, 3)]


def test_a_draft_of_another_vocabulary_is_refused(models, plain):
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the draft's vocabulary has 256 "
                                                r"tokens, the target's 512"):
        _spec_llm(plain, models.small_vocab)
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the draft model could not be loaded: "
                                                r".*no such file or directory"):
        _spec_llm(plain, models.target + "-missing")


def test_a_draft_with_another_tokenizer_is_refused():
    def loaded(vocab: dict[str, int]) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(vocab_size=len(vocab)),
                               tokenizer=SimpleNamespace(backend=SimpleNamespace(get_vocab=lambda: vocab)))

    check_draft_matches(loaded({"a": 0, "b": 1}), loaded({"a": 0, "b": 1}))
    with pytest.raises(EngineConfigError, match=r"speculative_config\.model: the draft's tokenizer differs"):
        check_draft_matches(loaded({"a": 0, "b": 1}), loaded({"a": 1, "b": 0}))
