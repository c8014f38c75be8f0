"""Tiny pre-quantized HF checkpoints written as the real tools write them, for tests: AutoAWQ's GEMM packing,
AutoGPTQ / GPTQModel's gptq (v1) and gptq_v2 formats, llm-compressor's compressed-tensors (pack-quantized 4-bit,
float-quantized fp8), and Qwen's / DeepSeek's fp8 with 128x128 block scales.

The packing here is written from the formats' documented layouts, independently of kvpilot's readers
(src/kvpilot/model/quant/int4_unpack.py, fp8_checkpoint.py), one nibble at a time. Each checkpoint quantizes the
decoder projections of a transformers model with random weights (min-max groups, as the tools' round-to-nearest
does) and keeps lm_head, embeddings and norms dense, as the tools do; the model's own weights are then set to the
dequantized values, so it is the float32 reference kvpilot must match token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8c + AWQ_ORDER[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


@dataclass
class Groups:
    """A weight [N, K] quantized in groups: w ~= (q - zeros[:, g_idx]) * scales[:, g_idx]."""

    q: torch.Tensor  # int64 [N, K], 0..15
    scales: torch.Tensor  # float32 [N, G], values of the checkpoint's scale dtype
    zeros: torch.Tensor  # int64 [N, G]
    g_idx: torch.Tensor  # int64 [K]

    def dequantized(self) -> torch.Tensor:
        return (self.q - self.zeros[:, self.g_idx]).to(torch.float32) * self.scales[:, self.g_idx]


def quantize_groups(w: torch.Tensor, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype,
                    g_idx: torch.Tensor | None = None, min_zero: int = 0) -> Groups:
    """Round-to-nearest 4-bit groups (group_size None: one group a row); `g_idx` maps each input column to its
    group (act-order), default k // group_size. Symmetric groups have zero point 8."""
    n, k = w.shape
    if g_idx is None:
        g_idx = torch.zeros(k, dtype=torch.int64) if group_size is None else torch.arange(k) // group_size
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scale = (cols.abs().amax(dim=1) * 2 / 15).clamp(min=1e-6).to(scale_dtype).float()
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-6).to(scale_dtype).float()
            zero = torch.round(-lo / scale).to(torch.int64).clamp(min_zero, 15)
        scales[:, g], zeros[:, g] = scale, zero
    q = torch.round(w / scales[:, g_idx]).to(torch.int64) + zeros[:, g_idx]
    return Groups(q.clamp(0, 15), scales, zeros, g_idx)


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """uint [..., 8] nibbles -> int32 [...] with nibble i in bits 4i..4i+3."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        word |= (nibbles[..., i].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return torch.from_numpy(word.view(np.int32).copy())


def pack_along_last(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C / 8]: word c of a row holds columns 8c.. (nibble i: column 8c + order[i])."""
    r, c = values.shape
    v = values.numpy().reshape(r, c // 8, 8)
    return _words(v[:, :, order] if order else v)


def pack_along_first(values: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R / 8, C]: word r of a column holds rows 8r + i in nibble i."""
    r, c = values.shape
    return _words(values.numpy().reshape(r // 8, 8, c).transpose(0, 2, 1))


def awq_tensors(g: Groups) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_last(g.q.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_along_last(g.zeros.t().contiguous(), AWQ_ORDER),
            "scales": g.scales.t().contiguous().to(torch.float16)}


def gptq_tensors(g: Groups, v1: bool) -> dict[str, torch.Tensor]:
    """v1 (`gptq`) stores each zero point minus one (AutoGPTQ's convention)."""
    return {"qweight": pack_along_first(g.q.t().contiguous()),
            "qzeros": pack_along_last(g.zeros.t().contiguous() - (1 if v1 else 0)),
            "scales": g.scales.t().contiguous().to(torch.float16), "g_idx": g.g_idx.to(torch.int32)}


def compressed_pack_tensors(g: Groups, symmetric: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """pack-quantized: signed values + 8, packed along the inputs; asymmetric zero points packed along the
    outputs (signed + 8 too); bfloat16 scales [N, G]."""
    n, k = g.q.shape
    out = {"weight_packed": pack_along_last(g.q), "weight_scale": g.scales.to(torch.bfloat16),
           "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        out["weight_zero_point"] = pack_along_first(g.zeros)
    if act_order:
        out["weight_g_idx"] = g.g_idx.to(torch.int32)
    return out


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [ceil(N / bn), ceil(K / bk)], dequantized) with scale = block amax / 448."""
    n, k = w.shape
    bn, bk = block
    scale = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax().clamp(min=1e-6) / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.to(torch.float32) * full


@dataclass
class Recipe:
    """How to write one checkpoint: `quantize(name, weight)` -> (tensors by suffix, dequantized weight)."""

    quantization_config: dict
    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # further tensors (e.g. kv scales)


def random_hf_model(cfg: dict, seed: int = 0):
    """A transformers model of `cfg`, every parameter random (norms and biases too), float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 0.3 if "norm" in name or name.endswith("bias") else 0.08
            param.copy_((1.0 if "norm" in name else 0.0) + std * torch.randn(param.shape, generator=generator))
    return model.eval()


def write_checkpoint(model, directory: Path, recipe: Recipe) -> None:
    """Quantizes `model`'s decoder projections by `recipe` into `directory` (config.json, model.safetensors)
    and sets them in `model` to their dequantized values."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            module, _, kind = name.rpartition(".")
            if kind == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS and module.startswith("model.layers."):
                quantized, dequantized = recipe.quantize(module, param.detach().clone())
                tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in quantized.items()})
                param.copy_(dequantized)
            else:
                tensors[name] = param.detach().clone().contiguous()
    tensors.update(recipe.extra)
    save_file(tensors, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = recipe.quantization_config
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
