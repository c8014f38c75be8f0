"""A request's prompts, one by one: a completion's batch (`prompt` as a list of texts or of token-id lists)
split into single-prompt bodies, tokenized together in one tokenizer-pool task, with each prompt's text to
echo. An error about prompt i of a batch names `prompt.i`."""

from __future__ import annotations

from typing import Any, Callable

from kvpilot.server.openai.errors import APIError
from kvpilot.server.prompt_tokens import TokenizedPrompt
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest

Tokenize = Callable[[Any, Any, int, int], TokenizedPrompt]  # prompt_tokens.tokenize_request's signature


def num_prompts(body: CompletionRequest | ChatCompletionRequest) -> int:
    return 1 if isinstance(body, ChatCompletionRequest) else len(body.prompts())


def prompt_bodies(body: CompletionRequest | ChatCompletionRequest) -> list[Any]:
    """One request body per prompt, each as tokenize_request reads it: the body itself for a single prompt,
    else a copy per prompt of the batch (the same fields, one prompt)."""
    if isinstance(body, ChatCompletionRequest):
        return [body]
    prompts = body.prompts()
    return [body] if len(prompts) == 1 else [body.model_copy(update={"prompt": p}) for p in prompts]


def tokenize_prompts(tokenize: Tokenize, bodies: list[Any], tokenizer: Any, vocab_size: int, limit: int,
                     echo: bool) -> list[tuple[TokenizedPrompt, str]]:
    """Each prompt's tokens (`tokenize`: prompt_tokens.tokenize_request, passed in so a caller can wrap it),
    and its text to echo ("" without `echo`). Runs in a tokenizer-pool worker."""
    results = []
    for i, body in enumerate(bodies):
        try:
            prompt = tokenize(body, tokenizer, vocab_size, limit)
        except APIError as exc:
            raise _indexed(exc, i) if len(bodies) > 1 and exc.param == "prompt" else exc
        results.append((prompt, echo_text(prompt, tokenizer) if echo else ""))
    return results


def echo_text(prompt: TokenizedPrompt, tokenizer: Any) -> str:
    """The prompt as text: as sent, or token ids decoded (special tokens kept, as vLLM echoes them)."""
    if prompt.text is not None:
        return prompt.text
    if tokenizer is None or prompt.token_ids is None:
        raise APIError(400, "echo: this model has no tokenizer, so token-id prompts cannot be echoed as text: "
                            "leave echo false", param="echo")
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _indexed(exc: APIError, i: int) -> APIError:
    """The same error about prompt i of a batch (`param: prompt.i`), of the same class (a PromptTooLongError
    stays one: the server counts it as too long)."""
    rest = exc.message[len("prompt:"):] if exc.message.startswith("prompt:") else f" {exc.message}"
    return type(exc)(exc.status, f"prompt.{i}:{rest}", param=f"prompt.{i}", code=exc.code, headers=exc.headers)
