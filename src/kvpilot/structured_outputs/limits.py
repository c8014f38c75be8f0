"""GrammarLimits: what one structured-outputs request may cost, and llguidance's errors told by the limit hit.

Every grammar is compiled with the same explicit llguidance limits wherever it is compiled (the HTTP
process's admission, the engine's check, the runner's matchers), so a grammar admitted under them runs
under them. Messages that travel (logs, responses, the messages between processes) are bounded: llguidance
is told not to dump its state and grammar into them (verbose_errors off), and `bounded` cuts what is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MAX_MESSAGE_CHARS = 400  # an llguidance error as quoted in our messages (it may quote the grammar)
_LLGUIDANCE_FIELDS = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                      "max_lexer_states", "max_grammar_size")


@dataclass(frozen=True)
class GrammarLimits:
    """Limits of one request's grammar. The llguidance fields are its LLParserLimits (their defaults but for
    initial_lexer_fuel: llguidance's 1,000,000 let one token mask of `(a{1000}){1000}` force bytes for ~1.4 s
    on the 2-vCPU box; 200,000 ends it in ~0.1 s); the others are kvpilot's. Invariant: every value > 0."""

    max_grammar_chars: int = 65_536  # the spec's text (schema JSON, regex, Lark, choice list): compiling
    #                                  costs ~0.3-1.1 ms per KiB here, once per spec, in the engine's step
    max_mask_ms: float = 25.0  # CPU time of one token's grammar work (feed it, compute the next mask): admission
    #                            refuses a grammar over it, the runner fails its request (JSON schemas: ~0.1-2 ms)
    num_probe_tokens: int = 4  # tokens admission feeds the grammar (llguidance finds some limits only then)
    max_items_in_row: int = 2_000  # Earley items alive at one point of the parse (alternatives, choices)
    initial_lexer_fuel: int = 200_000  # lexer work to build its regexes and force bytes (~50 per us)
    step_lexer_fuel: int = 200_000  # lexer work per token mask (~14 per us)
    step_max_items: int = 50_000  # Earley items per token mask (~20 per us)
    max_lexer_states: int = 250_000  # lexer DFA states (~1-2 kB each)
    max_grammar_size: int = 500_000  # symbols in the grammar's productions

    def __post_init__(self) -> None:
        bad = [name for name, value in asdict(self).items() if not value > 0]
        if bad:
            raise ValueError(f"GrammarLimits: {', '.join(bad)} must be > 0")

    @property
    def max_mask_s(self) -> float:
        return self.max_mask_ms / 1000

    def ll_limits(self) -> Any:
        """llguidance's LLParserLimits of these limits (short errors: no parser state, no grammar)."""
        from llguidance import LLParserLimits

        return LLParserLimits(**{name: getattr(self, name) for name in _LLGUIDANCE_FIELDS}, verbose_errors=False)


GRAMMAR_LIMITS = GrammarLimits()

# llguidance's error messages -> the limit each one means (checked in order, first match wins).
_LIMIT_OF_MESSAGE = (
    ("Current row has", "max_items_in_row"),
    ("Too many items", "step_max_items"),
    ("too many expressions constructed", "initial_lexer_fuel / step_lexer_fuel"),
    ("initial lexer configuration (grammar) too big", "initial_lexer_fuel"),
    ("too many states", "max_lexer_states"),
    ("grammar size (number of symbols) too big", "max_grammar_size"),
)
_HINTS = {
    "max_items_in_row": "use fewer alternatives at one point (fewer choices or enum values, or group them)",
    "step_max_items": "the grammar is too ambiguous: avoid many short or optional pieces in a row",
    "initial_lexer_fuel / step_lexer_fuel": "its regexes are too large or repeat too much (nested counted "
                                            "repeats such as (a{1000}){1000}, or a very long literal)",
    "initial_lexer_fuel": "its regexes are too large",
    "max_lexer_states": "its regexes need too many lexer states",
    "max_grammar_size": "send a smaller grammar",
}


def bounded(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """`text` on one line, without llguidance's verbose-errors marker, cut to max_chars."""
    text = " ".join(text.replace("<non-verbose/>", "").split())
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def over_budget(cpu_seconds: float, limits: GrammarLimits = GRAMMAR_LIMITS) -> str:
    """Why a grammar whose token took `cpu_seconds` (over max_mask_ms) is refused or failed."""
    return (f"one token of this grammar took {cpu_seconds * 1000:.0f} ms of CPU (feeding it and computing the next "
            f"mask), over the {limits.max_mask_ms:g} ms budget (max_mask_ms): it would hold up every request batched "
            "with it; simplify it (e.g. shorter literals, smaller counted repeats)")


def explain(error: str, limits: GrammarLimits = GRAMMAR_LIMITS) -> str:
    """llguidance's error, bounded, led by the limit it hit and what to change (as it is when none matches)."""
    for marker, name in _LIMIT_OF_MESSAGE:
        if marker in error:
            values = ", ".join(f"{n}={getattr(limits, n):,}" for n in name.split(" / "))
            return f"over llguidance's {name} limit ({values}): {_HINTS[name]} (llguidance: {bounded(error)})"
    if "NoExtension" in error:
        return ("the grammar matches no output at all (llguidance stopped with " + bounded(error, 40) + "): a JSON "
                "schema whose $refs only refer to each other, for example, has no value")
    return bounded(error)
