"""Which of a model's layers a pre-quantized checkpoint's weights become, fused as the shared decoder fuses them,
and how each is held on the device.

The shared decoder (models/llama.py) runs q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: their
quantized parts fuse the same way, concatenated along the outputs with their scales and zero points (GPTQ
act-order parts whose g_idx differ stay apart inside the layer; fp8 per-tensor parts become per-channel).
Checkpoints that already store them fused (Phi-3) map one to one. Quantized modules outside these four
(a quantized lm_head, MoE experts) are dequantized at load.

How a fused layer is held (`Holding.kind`):
- CPU, 4-bit groups mapping onto blocks of 32: "packed", GGUF Q4_0 / Q4_1 blocks in the CPU kernels
  (int4_blocks.py: same bytes a weight as 4-bit GGUF, the fused decode and VNNI paths included);
- CUDA, 4-bit: "int4", Int4Linear's Triton kernel;
- CUDA, fp8 one scale a row and sizes in 16s on fp8 tensor cores: "fp8", quant/fp8.py's Fp8Linear (activations
  quantized per token, as --quantization fp8); other fp8 layers: "fp8-triton", Fp8BlockLinear (weight-only);
- otherwise "dense": dequantized to --dtype at load (CPU fp8; act-order or odd groups on CPU; no kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.model.config import ModelConfig
from kvpilot.model.quant.checkpoint_tensors import QuantizedWeight
from kvpilot.model.quant.fp8_checkpoint import Fp8Weight
from kvpilot.model.quant.int4_blocks import block_mapping_problem

# model module (under layers.{i}.) -> the HF module lists whose parts it fuses, in order
TARGETS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("self_attn.qkv_proj", (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",))),
    ("self_attn.o_proj", (("self_attn.o_proj",),)),
    ("mlp.gate_up_proj", (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",))),
    ("mlp.down_proj", (("mlp.down_proj",),)),
)


@dataclass
class FusedLayer:
    """One model linear layer (`target`, e.g. layers.3.self_attn.qkv_proj) over quantized parts (`sources`: their
    HF module names, in fusion order); `bias`: the checkpoint has a bias for every part."""

    target: str
    sources: list[str]
    parts: list[QuantizedWeight]
    bias: bool

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features


@dataclass(frozen=True)
class KernelFamily:
    """What the device runs: "cpu" (the packed CPU kernels, if `cpu_kernels`) or "cuda" (Triton kernels if
    `triton`; e4m3 conversions in them if `fp8_e4m3`, and torch's row-scaled fp8 matmul if `fp8_matmul`: both
    compute capability 8.9 or newer)."""

    name: str
    cpu_kernels: bool = False
    triton: bool = False
    fp8_e4m3: bool = False
    fp8_matmul: bool = False


@dataclass(frozen=True)
class Holding:
    kind: str  # packed, int4, fp8, fp8-triton or dense
    reason: str | None = None  # dense: why


def kernel_family(device: torch.device) -> KernelFamily:
    """The kernels `device` offers for pre-quantized layers."""
    if device.type == "cpu":
        from kvpilot.model.quant.kernel import best_isa
        return KernelFamily("cpu", cpu_kernels=best_isa() >= 0)
    from kvpilot.model.attention.triton_support import triton_importable
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return KernelFamily(device.type, triton=triton_importable() and device.type == "cuda", fp8_e4m3=fp8,
                        fp8_matmul=fp8)


def plan_layers(quantized: dict[str, QuantizedWeight], config: ModelConfig,
                state: dict[str, torch.Tensor]) -> list[FusedLayer]:
    """The fused layers of every decoder layer whose parts are all quantized; their weights are removed from
    `quantized` (what is left there has no fused layer)."""
    layers = []
    for i in range(config.num_hidden_layers):
        for target, options in TARGETS:
            for names in options:
                sources = [f"model.layers.{i}.{name}" for name in names]
                if all(s in quantized for s in sources) and _same_kind([quantized[s] for s in sources]):
                    layers.append(FusedLayer(f"layers.{i}.{target}", sources, [quantized.pop(s) for s in sources],
                                             all(f"{s}.bias" in state for s in sources)))
                    break
    return layers


def _same_kind(parts: list[QuantizedWeight]) -> bool:
    return len({type(p) for p in parts}) == 1 and len({p.in_features for p in parts}) == 1


def holding_for(layer: FusedLayer, kernels: KernelFamily) -> Holding:
    """How `layer` is held on a device offering `kernels` (see the module docstring)."""
    fp8 = isinstance(layer.parts[0], Fp8Weight)
    if kernels.name == "cpu":
        if fp8:
            return Holding("dense", "the CPU kernels have no fp8 weights")
        if not kernels.cpu_kernels:
            return Holding("dense", "the CPU quantized-linear kernel could not be built")
        problem = next((p for p in map(block_mapping_problem, layer.parts) if p is not None), None)
        return Holding("packed") if problem is None else Holding("dense", f"{layer.sources[0]}: {problem}")
    if not fp8:
        return Holding("int4") if kernels.triton else Holding("dense", "Triton is not installed")
    try:
        fused = Fp8Weight.concat(layer.parts)
    except ValueError as exc:
        return Holding("dense", f"{layer.sources[0]}: {exc}")
    if kernels.fp8_matmul and fused.per_channel and fused.in_features % 16 == 0 and fused.out_features % 16 == 0:
        return Holding("fp8")
    if kernels.triton and kernels.fp8_e4m3:
        return Holding("fp8-triton")
    return Holding("dense", "fp8 weights need compute capability 8.9 or newer (Ada, Hopper) and Triton")
