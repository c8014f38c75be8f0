"""Which token ids end generation, read from a model's files: every family's end-of-turn tokens, not just
the one `eos_token`.

Chat models end a turn with a token that is often not the tokenizer's eos: Gemma `<end_of_turn>` (id 106,
beside `<eos>`), Llama 3 `<|eot_id|>` (and 3.1's `<|eom_id|>` after a tool call), Qwen `<|im_end|>`, Phi-3
`<|end|>`, gpt-oss `<|return|>` and `<|call|>`. Where they are written down, they are read:

* an HF directory: config.json's `eos_token_id` (the loader passes it), generation_config.json's
  `eos_token_id` (an int or a list: where HF lists them all), tokenizer_config.json's `eos_token`;
* a GGUF: `tokenizer.ggml.eos_token_id`, `tokenizer.ggml.eot_token_id` and `tokenizer.ggml.eom_token_id`.

GGUF files converted from HF often carry only the one eos id, so there, as llama.cpp does, a control token
whose text is a known end-of-turn token ends generation too; so it does in an HF directory that has no
generation_config.json. The exception: with gpt-oss's harmony format (its vocabulary has `<|return|>`),
`<|end|>` closes one message of a turn (the analysis before the final answer), not the turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvpilot.model.errors import ModelLoadError

END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|return|>",
                     "<|call|>")
HARMONY_RETURN = "<|return|>"
HARMONY_MESSAGE_END = "<|end|>"
GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def int_ids(value: Any) -> list[int]:
    """An `eos_token_id` value as a list: an int, a list of ints, or absent / null (no ids)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def end_of_turn_ids(special_ids: dict[str, int]) -> list[int]:
    """The ids of the known end-of-turn tokens among `special_ids` (a control / special token's text -> id)."""
    texts = [t for t in END_OF_TURN_TEXTS if t != HARMONY_MESSAGE_END or HARMONY_RETURN not in special_ids]
    return [special_ids[t] for t in texts if t in special_ids]


def merged(*groups: Iterable[int | None]) -> tuple[int, ...]:
    """The ids of every group in order, each once (None skipped)."""
    return tuple(dict.fromkeys(i for group in groups for i in group if i is not None))


def generation_config_eos(directory: Path) -> list[int] | None:
    """generation_config.json's eos ids; None when the directory has no such file."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: malformed JSON ({exc})") from exc
    return int_ids(config.get("eos_token_id")) if isinstance(config, dict) else []


def gguf_eos_ids(fields: dict[str, Any], tokens: list[str], token_types: list[int] | None,
                 control_type: int) -> tuple[int, ...]:
    """A GGUF's stop ids: its eos / eot / eom ids (`fields`: those keys' values, None when absent), then its
    control tokens that are known end-of-turn tokens."""
    control = {tokens[i]: i for i, kind in enumerate(token_types or []) if kind == control_type
               and i < len(tokens) and tokens[i] in END_OF_TURN_TEXTS}
    written = [int(fields[key]) for key in GGUF_EOS_KEYS if fields.get(key) is not None]
    return merged(written, end_of_turn_ids(control))
