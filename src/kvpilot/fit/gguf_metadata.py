"""Reads a GGUF file's header: hyper-parameters as an HF-style config dict, and the tokenizer fields.

Torch-free, so it lives with the planner: `fit` sizes GGUF models from it, and the model loader and
tokenizer (kvpilot.model) read their GGUF metadata through it too. Every failure is a GgufError naming
the file (the loader reports it as a ModelLoadError).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from kvpilot.fit.errors import GgufError
from kvpilot.fit.gguf_rope import gguf_rope_fields

# GGUF `general.architecture` -> HF `architectures[0]`
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# GGUF `general.architecture` -> HF `model_type`, where the two differ
GGUF_MODEL_TYPES: dict[str, str] = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
# llama.cpp's Gemma 2/3: the 27B models (by layer count) scale attention by hidden / heads, the others by
# head_dim (the GGUF stores no query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@cache
def _reader_class() -> type:
    """`gguf.GGUFReader` over a plain ndarray view of its memory map, reading arrays in bulk.

    The stock reader slices its map once per metadata item, one array element at a time (two slices per
    vocabulary string, each with a byte-order view), and every slice of a `numpy.memmap` runs Python hooks:
    3.0 s of the embedded model's 49k-token vocabulary, 0.7 s on a plain view of the same read-only mapping
    (which it keeps alive as its base). Here an array of numbers is one view and an array of strings one
    memoryview slice per string: ~0.1 s (2-vCPU Xeon: 1.1 s before). Field contents are the stock reader's
    (tests/model/test_load_time.py compares every field); read them with `contents()`.
    """
    import struct
    import sys

    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    length_at = struct.Struct("<Q").unpack_from

    class PlainViewReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, mapped: Any) -> None:
            self._plain_data = mapped.view(np.ndarray)
            self._bytes = memoryview(self._plain_data)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            item_type, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            parts: list[Any] = [raw_itype, alen]
            if count == 0:  # as the stock reader: no element, so no element type
                return 12, parts, [], [GGUFValueType.ARRAY]
            if item_type == GGUFValueType.STRING:
                buffer = self._bytes
                for _ in range(count):
                    (size,) = length_at(buffer, offs)
                    parts.append(buffer[offs + 8: offs + 8 + size])  # .tobytes() as contents() reads it
                    offs += 8 + size
                return offs - orig_offs, parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, item_type]
            nptype = self.gguf_scalar_to_np.get(item_type)
            if nptype is None:  # nested arrays: the stock reader's element-wise walk
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), parts + [values], [2], [GGUFValueType.ARRAY, item_type]

    return PlainViewReader


def open_gguf(path: str | Path) -> Any:
    """Opens a GGUF file with the `gguf` package; a missing, truncated or corrupt file is a GgufError."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"{path}: no such GGUF file")
    GGUFReader = _reader_class()

    try:
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GgufError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        return GGUFReader(str(path))
    except GgufError:
        raise
    except Exception as exc:  # the gguf reader raises ValueError, IndexError, struct errors...
        raise GgufError(f"{path}: GGUF file is truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of one metadata field, or `default` when absent."""
    fld = reader.fields.get(key)
    if fld is None:
        return default
    value = fld.contents()
    return value


def _arch_key(reader: Any, arch: str, key: str, path: Path, required: bool = True) -> Any:
    value = field_value(reader, f"{arch}.{key}")
    if value is None and required:
        raise GgufError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
    return value


def hf_config_from_reader(reader: Any, path: str | Path) -> dict[str, Any]:
    """Builds an HF-style config dict from an open GGUF reader (see `hf_config_from_gguf`)."""
    path = Path(path)
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise GgufError(f"{path}: unsupported GGUF architecture {arch!r}; kvpilot supports {supported}")
    heads = int(_arch_key(reader, arch, "attention.head_count", path))
    hidden = int(_arch_key(reader, arch, "embedding_length", path))
    vocab = _arch_key(reader, arch, "vocab_size", path, required=False)
    if not vocab:  # the token list's length (decoding 49k strings: only when the size is not stored)
        vocab = len(field_value(reader, "tokenizer.ggml.tokens") or []) or None
    if vocab is None:
        raise GgufError(f"{path}: GGUF metadata has neither '{arch}.vocab_size' nor a token list")
    tensor_names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": GGUF_MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(_arch_key(reader, arch, "feed_forward_length", path)),
        "num_hidden_layers": int(_arch_key(reader, arch, "block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_arch_key(reader, arch, "attention.head_count_kv", path, False) or heads),
        "head_dim": int(_arch_key(reader, arch, "attention.key_length", path, False) or hidden // heads),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(_arch_key(reader, arch, "attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(_arch_key(reader, arch, "rope.freq_base", path, False) or 10000.0),
        "max_position_embeddings": int(_arch_key(reader, arch, "context_length", path, False) or 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "_name_or_path": str(field_value(reader, "general.name", path.stem)),
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    cfg.update(_moe_fields(reader, arch, path))
    if arch in _GEMMA_27B_LAYERS:
        cfg.update(_gemma_fields(reader, arch, cfg, path))
    rope_tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}
    cfg.update(gguf_rope_fields(lambda key: _arch_key(reader, arch, key, path, False), rope_tensors, cfg, path))
    if arch == "gpt-oss":
        cfg.update(_gpt_oss_fields(reader, cfg, path))
    if arch == "phi3" and _arch_key(reader, arch, "attention.sliding_window", path, False):
        cfg["sliding_window"] = int(_arch_key(reader, arch, "attention.sliding_window", path))
    return cfg


def _gemma_fields(reader: Any, arch: str, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """A Gemma 2/3 GGUF's HF config keys beyond the Llama ones, read as llama.cpp reads them. A key the file
    lacks is left out (the family's transformers default applies: Gemma 2 soft-caps at 50 and 30)."""
    stored = {"sliding_window": "attention.sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
              "final_logit_softcapping": "final_logit_softcapping"}
    fields = {hf: value for hf, key in stored.items()
              if (value := _arch_key(reader, arch, key, path, False)) is not None}
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    fields["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    if arch == "gemma3":
        fields["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base of the sliding layers
        pattern = _arch_key(reader, arch, "attention.sliding_window_pattern", path, False)
        if isinstance(pattern, list):  # one flag a layer: true where it slides
            fields["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            fields["sliding_window_pattern"] = int(pattern or 6)
    return fields


def _gpt_oss_fields(reader: Any, cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """gpt-oss's keys beyond the MoE ones, as llama.cpp's graph runs it: every other layer slides (the first
    does), biases on attention, the router and the experts; SwiGLU clamped at 7.0 with alpha 1.702 (its fixed
    values, and transformers' defaults); YaRN without truncating its correction range, as every released gpt-oss
    config.json says (the file has no key for it)."""
    layers = cfg["num_hidden_layers"]
    fields: dict[str, Any] = {
        "sliding_window": int(_arch_key(reader, "gpt-oss", "attention.sliding_window", path)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True, "num_local_experts": cfg.pop("num_experts"),
        "experts_per_token": cfg["num_experts_per_tok"]}
    if "moe_intermediate_size" in cfg:  # transformers' gpt-oss names the experts' width intermediate_size
        fields["intermediate_size"] = cfg.pop("moe_intermediate_size")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        fields["rope_scaling"] = {**scaling, "truncate": False}
    return fields


def _moe_fields(reader: Any, arch: str, path: Path) -> dict[str, Any]:
    """A mixture-of-experts GGUF's HF config keys ({} for a dense model). llama.cpp writes Mixtral as
    `llama` with an expert count (the experts as wide as feed_forward_length), Qwen3-MoE as `qwen3moe` with the
    experts' own width; its qwen3moe graph renormalises the top-k weights unless the file says otherwise."""
    count = _arch_key(reader, arch, "expert_count", path, False)
    if not count:
        return {}
    used = int(_arch_key(reader, arch, "expert_used_count", path))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": int(count),
                "num_experts_per_tok": used}
    fields: dict[str, Any] = {"num_experts": int(count), "num_experts_per_tok": used}
    width = _arch_key(reader, arch, "expert_feed_forward_length", path, False)
    if width:
        fields["moe_intermediate_size"] = int(width)
    if arch == "qwen3moe":
        fields["norm_topk_prob"] = bool(_arch_key(reader, arch, "expert_weights_norm", path, False) in (None, True))
    return fields


def hf_config_from_gguf(path: str | Path) -> dict[str, Any]:
    """An HF config.json-like dict (architectures, sizes, rope, eos/bos ids) read from a GGUF file's metadata.

    Raises GgufError naming the file for a missing/corrupt file or an unsupported architecture.
    """
    return hf_config_from_reader(open_gguf(path), path)
