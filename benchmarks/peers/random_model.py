"""A Hugging Face model directory with random weights, for engines that load only from files (nano-vllm): the
catalog model's config.json, its weights as safetensors written by transformers (seeded initialisation, bf16
unless asked), and a word-level tokenizer with one token per id (`<17>`), so that token-id prompts and the
engines' final detokenisation both work without the real tokenizer. Every engine of a comparison loads this
one directory: the same weights in the same format."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def write_tokenizer(directory: Path, vocab_size: int, eos_token_id: int) -> None:
    """tokenizer.json + tokenizer_config.json: a word-level vocabulary of `vocab_size` tokens split on spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token_text(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=token_text(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=token_text(0),
                                   eos_token=token_text(eos_token_id))
    fast.save_pretrained(str(directory))


def write_random_model(directory: Path, hf_config: dict, seed: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes config.json, the weights and the tokenizer into `directory` (created); returns it. The weights
    are transformers' own initialisation of the architecture under torch.manual_seed(seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps(hf_config))
    config = AutoConfig.from_pretrained(str(directory))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(directory), safe_serialization=True)
    eos = hf_config["eos_token_id"]
    write_tokenizer(directory, hf_config["vocab_size"], eos[0] if isinstance(eos, list) else eos)
    return directory
