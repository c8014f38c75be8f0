"""How much of an answer copies its prompt, measured from the texts the client sent and received.

An output word is *copied* when it and the ``COPY_CONTEXT`` output words before it occur, in that order, in
the prompt: exactly the word an n-gram prompt-lookup drafter (vLLM's and kvpilot's ``"method": "ngram"``)
would have proposed from that context, had the context matched once. The share of copied words is what such
a drafter could have saved a request; the doctor's prompt-copying rule turns it into a speed-up estimate.

Words, not tokens: the client has no tokenizer of the server's in general, and a copied span is copied in
either unit. Words are runs of letters/digits or single punctuation marks, compared case-sensitively (a
drafter matches ids, which differ between "The" and "the").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COPY_CONTEXT = 3
"""Output words that must precede a word in the prompt for it to count as copied (vLLM's ngram
``prompt_lookup_min`` is of this order; shorter contexts match common phrases by chance)."""

_WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class CopyCount:
    """``num_copied_words`` of an output's ``num_output_words`` continue a span of its prompt.
    Invariant: ``0 <= num_copied_words <= num_output_words``."""

    num_output_words: int
    num_copied_words: int


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def count_copied(prompt: str, output: str, context: int = COPY_CONTEXT) -> CopyCount:
    """The copied words of ``output`` (module docstring); its first ``context`` words have no context of
    their own and count as not copied."""
    out = words(output)
    wanted = {tuple(out[i - context:i + 1]) for i in range(context, len(out))}
    starts = {gram[0] for gram in wanted}
    src = words(prompt)
    # Only the prompt's spans the output could match are built: this runs on the load generator's event loop,
    # once per request, and prompts can be tens of thousands of words.
    found = {gram for i, word in enumerate(src[:len(src) - context]) if word in starts
             and (gram := tuple(src[i:i + context + 1])) in wanted}
    copied = sum(1 for i in range(context, len(out)) if tuple(out[i - context:i + 1]) in found)
    return CopyCount(len(out), copied)
