"""Tokenizing in the pool: the same ids as Tokenizer.encode / encode_chat, huge prompts only counted, the
pool's lanes and threads, and the admission ticket taken before tokenizing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from kvpilot.server.admission import AdmissionController, QueueLimits
from kvpilot.server.openai.errors import APIError
from kvpilot.server.prompt_tokens import PromptTooLongError, encode, prompt_size, render_chat, tokenize_request
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.tokenizer_pool import TokenizerPool

TEXTS = ["The capital of France is", "  leading spaces and\nnew lines\t", "héllo wörld ✓ 日本語",
         "<|im_start|>user\nhi<|im_end|>", "x" * 5000]


@pytest.fixture(scope="module")
def tokenizer(llm_fp32):
    return llm_fp32.tokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_the_tokenizer(tokenizer, text: str, add_special_tokens: bool) -> None:
    expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert encode(tokenizer, text, add_special_tokens, 10**9).token_ids == expected


def test_encode_applies_the_bos_rule(tokenizer) -> None:
    with_bos = dataclasses.replace(tokenizer, add_bos=True, bos_token_id=1,
                                   special_tokens={**tokenizer.special_tokens, "bos_token": "<|im_start|>"})
    for text in ("plain text", "<|im_start|>already there"):
        expected = with_bos.encode(text)
        assert encode(with_bos, text, True, 10**9).token_ids == expected
        counted = encode(with_bos, text, True, 1)  # over the cap: counted, not materialized
        assert counted.token_ids is None and counted.num_tokens == len(expected)


def test_chat_matches_encode_chat(tokenizer) -> None:
    body = ChatCompletionRequest(messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What is 2 + 2?"}])
    prompt = tokenize_request(body, tokenizer, 49152, 4096)
    assert prompt.token_ids == tokenizer.encode_chat(body.conversation(), True)
    assert render_chat(tokenizer, body.conversation(), True).endswith("assistant\n")


def test_a_prompt_over_the_cap_is_counted_not_materialized(tokenizer) -> None:
    text = "one two three four five six seven eight nine ten " * 50
    prompt = encode(tokenizer, text, True, 100)
    assert prompt.token_ids is None and prompt.num_tokens == len(tokenizer.encode(text)) > 100
    for body, num_tokens in ((CompletionRequest(prompt=text), prompt.num_tokens),
                             (CompletionRequest(prompt=[10**9] * 101), 101)):  # too long: ids not even checked
        with pytest.raises(PromptTooLongError) as caught:
            tokenize_request(body, tokenizer, 49152, 100)
        assert caught.value.param == "prompt" and f"the prompt has {num_tokens} tokens" in caught.value.message


@pytest.mark.parametrize(("prompt", "words"), [("", "empty"), ([], "empty"), ([5, 49152], "outside the vocabulary")])
def test_unusable_prompts_are_400(tokenizer, prompt, words: str) -> None:
    with pytest.raises(APIError) as caught:
        tokenize_request(CompletionRequest(prompt=prompt), tokenizer, 49152, 4096)
    assert caught.value.status == 400 and words in caught.value.message and caught.value.param == "prompt"


def test_no_tokenizer_means_token_ids_only() -> None:
    with pytest.raises(APIError, match="no tokenizer"):
        tokenize_request(CompletionRequest(prompt="hi"), None, 100, 10)
    assert tokenize_request(CompletionRequest(prompt=[1, 2]), None, 100, 10).token_ids == [1, 2]


def test_prompt_size_reads_without_tokenizing() -> None:
    assert prompt_size(CompletionRequest(prompt="abc")) == 3
    assert prompt_size(CompletionRequest(prompt=[[1, 2, 3, 4]])) == 4
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "ab"},
                                           {"role": "user", "content": [{"type": "text", "text": "cde"}]}])
    assert prompt_size(chat) == 5


def test_pool_runs_work_off_the_calling_thread_in_two_lanes() -> None:
    pool = TokenizerPool(small_workers=1, large_workers=1, large_size=100)

    async def main() -> tuple[str, str, threading.Thread]:
        small = await pool.run(10, lambda: threading.current_thread().name)
        large = await pool.run(100, lambda: threading.current_thread().name)
        return small, large, threading.current_thread()

    try:
        small, large, caller = asyncio.run(main())
        assert small.startswith("kvpilot-tokenize_") and large.startswith("kvpilot-tokenize-large_")
        assert caller.name not in (small, large)
        with pytest.raises(APIError):
            asyncio.run(pool.run(1, _raise_400))
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError):
        asyncio.run(pool.run(1, len, "x"))


def _raise_400() -> None:
    raise APIError(400, "bad prompt")


def test_admission_reserves_a_slot_before_the_token_count_is_known() -> None:
    admission = AdmissionController(QueueLimits(max_num_queued_reqs=2, max_num_queued_tokens=64))
    admission.reserve("tokenizing")  # holds its place while its prompt is tokenized
    admission.admit("a", 60)
    with pytest.raises(APIError) as caught:
        admission.reserve("c")
    assert caught.value.code == "queue_full_requests"
    with pytest.raises(APIError) as caught:
        admission.commit("tokenizing", 10)  # 60 + 10 > 64: 429, and the slot is given back
    assert caught.value.code == "queue_full_tokens"
    assert (admission.num_queued_reqs, admission.num_queued_tokens) == (1, 60)
    admission.release("a")
    admission.reserve("long")
    admission.reserve("other")
    admission.commit("long", 100)  # no other request holds tokens: a prompt over the cap may enter alone
    assert (admission.num_queued_reqs, admission.num_queued_tokens) == (2, 100)
    with pytest.raises(KeyError):
        admission.commit("never-reserved", 1)
