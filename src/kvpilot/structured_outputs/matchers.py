"""llguidance matchers of a spec for the model's tokenizer, under GrammarLimits: the one way kvpilot builds
them (the HTTP process's admission probe and the runner's per-row matchers), so both see the same grammar
under the same limits."""

from __future__ import annotations

from typing import Any, Sequence

from kvpilot.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from kvpilot.structured_outputs.limits import GRAMMAR_LIMITS, GrammarLimits, explain


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a kvpilot Tokenizer (built from its `tokenizers` backend: ~0.2 s for a 49k
    vocabulary). StructuredOutputsError for a model without a tokenizers backend or an EOS token."""
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend", None)
    if backend is None or not eos_token_ids:
        raise StructuredOutputsError("structured outputs need the model's tokenizer (tokenizers-based) and an EOS "
                                     "token; this model has none")
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))


def compile_matcher(ll_tok: Any, spec: StructuredOutputsParams, limits: GrammarLimits = GRAMMAR_LIMITS) -> Any:
    """A matcher at the start of `spec`'s grammar; StructuredOutputsError (bounded, naming the limit hit) if
    it does not compile. llguidance drops the GIL while it compiles."""
    from llguidance import LLMatcher

    try:
        grammar = spec.grammar_text()
    except StructuredOutputsError as exc:
        error = str(exc)
    else:
        matcher = LLMatcher(ll_tok, grammar, log_level=0, limits=limits.ll_limits())
        if not matcher.is_error():
            return matcher
        error = explain(matcher.get_error(), limits)
    raise StructuredOutputsError(f"structured_outputs.{spec.kind}: the grammar does not compile: {error}")
