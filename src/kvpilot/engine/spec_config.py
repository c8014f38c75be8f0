"""`speculative_config`: speculative decoding's settings, vLLM's names and JSON (`LLM(speculative_config={...})`,
`kvpilot serve --speculative-config '{...}'`), validated at start with EngineConfigError naming the field.

Three proposers: "ngram" (prompt lookup), "draft_model" (a smaller model kvpilot loads, named by "model";
vLLM's `{"model": PATH}` alone means it too) and EAGLE draft heads, "eagle" (EAGLE-1) and "eagle3" (EAGLE-3),
whose checkpoint "model" names (model/models/eagle.py). Medusa, MTP and the rest are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.engine.config import EngineConfigError

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # the methods whose drafts come from weights "model" names
NOT_YET = ("medusa", "mlp_speculator", "mtp", "suffix")
DEFAULT_LOOKUP = 5  # vLLM's: neither prompt_lookup_min nor _max given -> both 5; one given -> the other equals it
MAX_SPECULATIVE_TOKENS = 64


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"{_field(name)} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Invariants: method is one of METHODS; model (the draft's or EAGLE head's path, hub id or, for a draft,
    dummy name) is set exactly when method is in MODEL_METHODS; 1 <= num_speculative_tokens <=
    MAX_SPECULATIVE_TOKENS (the most drafts a request gets in one step; the cost model often gives fewer, or
    none); 1 <= prompt_lookup_min <= prompt_lookup_max (the n-gram lengths matched, longest first);
    disable_by_batch_size: None, or >= 1 (no request speculates in a step where at least this many run: a hard
    cap on top of the cost model)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise EngineConfigError(f"{_field('method')} {self.method!r} is not supported yet: kvpilot has the "
                                    f"n-gram, draft-model and EAGLE proposers (\"method\": one of "
                                    f"{', '.join(METHODS)})")
        if self.method not in METHODS:
            raise EngineConfigError(f"{_field('method')} must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            what = "the draft's directory, GGUF file or Hub id" if self.method == "draft_model" else \
                "the EAGLE head's directory (config.json and safetensors) or Hub id"
            raise EngineConfigError(f"{_field('model')} is required with method \"{self.method}\": {what}, got "
                                    f"{self.model!r}")
        if self.method == "ngram" and self.model is not None:
            raise EngineConfigError(f"{_field('model')} is for methods {', '.join(MODEL_METHODS)}; the n-gram "
                                    f"proposer takes no model, got {self.model!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise EngineConfigError(f"{_field('num_speculative_tokens')} must be <= {MAX_SPECULATIVE_TOKENS}, got "
                                    f"{self.num_speculative_tokens}")
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineConfigError(f"{_field('prompt_lookup_min')} ({self.prompt_lookup_min}) must be <= "
                                    f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's keys; `"model": "[ngram]"` (its older spelling) means method ngram, any other model without
        a method means draft_model. Unknown keys are refused by name rather than ignored: a typo must not
        silently turn speculation into something else."""
        values = dict(values)
        if values.get("model") in ("ngram", "[ngram]") and "method" not in values:
            values["method"] = "ngram"
        if values.get("model") is not None and "method" not in values:
            values["method"] = "draft_model"
        if values.get("method") == "ngram":
            values.pop("model", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineConfigError(f"speculative_config has unsupported keys {unknown}: kvpilot reads {sorted(known)}")
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        values["prompt_lookup_min"] = low if low is not None else high if high is not None else DEFAULT_LOOKUP
        values["prompt_lookup_max"] = high if high is not None else values["prompt_lookup_min"]
        return cls(**values)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineConfigError(f"--speculative-config is not valid JSON ({exc.msg}): pass an object such as "
                                    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
                                    ) from exc
        if not isinstance(values, dict):
            raise EngineConfigError("--speculative-config must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """EngineArgs.speculative_config as given (a config, a dict, JSON text, or None: off) -> a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise EngineConfigError(f"speculative_config must be a dict (vLLM's keys) or JSON text, got "
                                f"{type(value).__name__}")
