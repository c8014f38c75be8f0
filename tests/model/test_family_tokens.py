"""Every family's end-of-turn tokens end generation, read from the model's files (model/stop_tokens.py):
generation_config.json's eos list (Gemma's `<eos>` and `<end_of_turn>` 106), GGUF's eot / eom ids, and, where
the files name only one eos, the known end-of-turn control tokens (llama.cpp's rule), but never gpt-oss's
`<|end|>`, which ends one message of a turn. A GGUF's user-defined tokens (Qwen3's `<think>`) are one token
each, as the model was trained. Tokenizers built in the test with the `tokenizers` library or `gguf`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import AddedToken, Tokenizer as BackendTokenizer, models, pre_tokenizers

from kvpilot.fit.gguf_metadata import open_gguf
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.tokenizer import (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED, tokenizer_from_gguf,
                                    tokenizer_from_hf_dir)

GEMMA_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 105: "<start_of_turn>", 106: "<end_of_turn>"}
HARMONY_SPECIALS = {0: "<|endoftext|>", 1: "<|start|>", 2: "<|end|>", 3: "<|message|>", 4: "<|return|>",
                    5: "<|call|>", 6: "<|channel|>"}
PHI3_SPECIALS = {0: "<|endoftext|>", 1: "<|user|>", 2: "<|assistant|>", 3: "<|end|>"}


def _vocab(specials: dict[int, str], size: int) -> list[str]:
    return [specials.get(i, f"w{i}") for i in range(size)]


def _write_hf_dir(directory: Path, specials: dict[int, str], size: int = 110, eos: str | None = None,
                  generation_eos: object = None) -> Path:
    """tokenizer.json (a word-level vocabulary, `specials` as special added tokens), tokenizer_config.json
    naming `eos`, and generation_config.json with `generation_eos` (none when it is None)."""
    vocab = _vocab(specials, size)
    backend = BackendTokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials.values()])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos} if eos else {}))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


def test_generation_config_lists_every_eos(tmp_path: Path) -> None:
    """Gemma 3: config.json says 1 (`<eos>`), generation_config.json [1, 106]: `<end_of_turn>` ends a turn."""
    directory = _write_hf_dir(tmp_path, GEMMA_SPECIALS, eos="<eos>", generation_eos=[1, 106])
    tokenizer = tokenizer_from_hf_dir(directory, eos_token_ids=(1,))
    assert tokenizer.eos_token_ids == (1, 106)
    assert tokenizer.backend.token_to_id("<end_of_turn>") == 106


def test_generation_config_with_one_id_and_tokenizer_config_eos(tmp_path: Path) -> None:
    directory = _write_hf_dir(tmp_path, GEMMA_SPECIALS, eos="<end_of_turn>", generation_eos=1)
    assert tokenizer_from_hf_dir(directory).eos_token_ids == (1, 106)


def test_without_generation_config_known_turn_ends_stand_in(tmp_path: Path) -> None:
    gemma = tokenizer_from_hf_dir(_write_hf_dir(tmp_path / "gemma", GEMMA_SPECIALS, eos="<eos>"))
    assert gemma.eos_token_ids == (1, 106)
    phi3 = tokenizer_from_hf_dir(_write_hf_dir(tmp_path / "phi3", PHI3_SPECIALS, size=8, eos="<|endoftext|>"))
    assert phi3.eos_token_ids == (0, 3)  # Phi-3 ends a turn with <|end|>
    harmony = tokenizer_from_hf_dir(_write_hf_dir(tmp_path / "gpt-oss", HARMONY_SPECIALS, size=8,
                                                  eos="<|return|>"))
    assert harmony.eos_token_ids == (4, 5)  # <|return|> and <|call|>; <|end|> only ends the analysis message


def test_malformed_generation_config_is_a_load_error(tmp_path: Path) -> None:
    directory = _write_hf_dir(tmp_path, GEMMA_SPECIALS, eos="<eos>")
    (directory / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json: malformed JSON"):
        tokenizer_from_hf_dir(directory)


def _write_gguf(path: Path, specials: dict[int, str], size: int, plain: dict[int, str] | None = None,
                user: dict[int, str] | None = None, **ids: int) -> Path:
    """A GGUF holding only a gpt2-style vocabulary: `specials` as control tokens, `plain` as normal ones, `user`
    as user-defined ones, `ids` (eos, eot, eom)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_vocab({**(plain or {}), **(user or {}), **specials}, size))
    writer.add_token_types([GGUF_TOKEN_TYPE_CONTROL if i in specials else GGUF_TOKEN_TYPE_USER_DEFINED
                            if i in (user or {}) else 1 for i in range(size)])
    writer.add_token_merges([])
    for kind, token_id in ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA3_SPECIALS = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|eom_id|>", 3: "<|eot_id|>",
                   4: "<|python_tag|>"}


def test_gguf_eot_and_eom_ids_end_generation(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "llama3.gguf", {**LLAMA3_SPECIALS, 9: "<|reserved|>"}, 12, eos=1, eot=9, eom=2)
    tokenizer = tokenizer_from_gguf(open_gguf(path), path)
    # the written ids first, then the known turn ends among the control tokens (<|eot_id|> is not written here)
    assert tokenizer.eos_token_ids == (1, 9, 2, 3)


@pytest.mark.parametrize("specials, eos, expected", [
    (GEMMA_SPECIALS, 1, (1, 106)),
    (HARMONY_SPECIALS, 4, (4, 5)),
    (PHI3_SPECIALS, 0, (0, 3)),
], ids=["gemma", "gpt-oss", "phi3"])
def test_gguf_with_one_eos_also_stops_at_known_turn_ends(tmp_path: Path, specials, eos, expected) -> None:
    path = _write_gguf(tmp_path / "model.gguf", specials, 110, eos=eos)
    assert tokenizer_from_gguf(open_gguf(path), path).eos_token_ids == expected


def test_a_normal_token_spelled_like_a_turn_end_is_not_one(tmp_path: Path) -> None:
    """Only control tokens count: a normal token with the text `<|im_end|>` (a vocabulary's literal text) does
    not end generation."""
    path = _write_gguf(tmp_path / "plain.gguf", {0: "<s>", 1: "</s>"}, 4, plain={2: "<|im_end|>"}, eos=1)
    assert tokenizer_from_gguf(open_gguf(path), path).eos_token_ids == (1,)


def test_gguf_user_defined_tokens_are_whole_tokens(tmp_path: Path) -> None:
    """Qwen3's GGUF keeps <think> and </think> as user-defined tokens: a prompt's `<think>` is that one id
    (the reasoning parser reads it back as text), not pieces spelled out by the BPE."""
    plain = {2: "a", 3: "b", 4: "<", 5: "t", 6: ">"}
    path = _write_gguf(tmp_path / "qwen3.gguf", {0: "<|endoftext|>", 1: "<|im_end|>"}, 10, plain=plain,
                       user={7: "<think>", 8: "</think>"}, eos=1)
    tokenizer = tokenizer_from_gguf(open_gguf(path), path)
    ids = tokenizer.encode("a<think>b</think>a")
    assert ids == [2, 7, 3, 8, 2]
    assert tokenizer.decode(ids) == "a<think>b</think>a"  # not special: kept when special tokens are skipped
