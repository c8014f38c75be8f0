"""Loading a pre-quantized HF checkpoint (AWQ, GPTQ, fp8, compressed-tensors) into a model, in the loader's
order (model/loader.py, _load_hf_dir):

1. PrequantizedLoad(...) takes the quantized tensors out of the state dict, plans the fused layers and how each
   is held (checkpoint_layers.py); layers held dense, and quantized modules no fused layer takes, are
   dequantized into the state dict under their HF weight names, where the model's own fusion finds them
   (a warning says how many and what they cost);
2. prepare(model), on the meta-device model: each held layer's nn.Linear becomes a PendingLinear (its dense
   weight is never allocated; its bias, if any, loads with the dense weights);
3. install(model), after model.load_weights: the pending layers become their quantized modules.
"""

from __future__ import annotations

import logging

import psutil
import torch
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.quant.checkpoint_layers import FusedLayer, Holding, holding_for, kernel_family, plan_layers
from kvpilot.model.quant.checkpoint_scheme import CheckpointScheme
from kvpilot.model.quant.checkpoint_tensors import QuantizedWeight, take_quantized
from kvpilot.model.quant.fp8 import Fp8Linear
from kvpilot.model.quant.fp8_checkpoint import Fp8Weight
from kvpilot.model.quant.int4_blocks import offset_error, to_blocks
from kvpilot.model.quant.prequant_linear import Fp8BlockLinear, Int4Linear

logger = logging.getLogger("kvpilot")


class PendingLinear(nn.Module):
    """A planned quantized layer's place in the model until install(): sizes, and the bias if it has one."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pre-quantized layer was not installed (PrequantizedLoad.install)")


class PrequantizedLoad:
    """One checkpoint's quantized layers through prepare() and install() (see the module docstring).
    `dense_only` (--quantization none) dequantizes them all; `hybrid` allows the CPU packed layers' dense copy
    for many-row GEMMs (as --quantization auto does for GGUF files)."""

    def __init__(self, state: dict[str, torch.Tensor], scheme: CheckpointScheme, config: ModelConfig, source: str,
                 device: torch.device, dtype: torch.dtype, dense_only: bool = False,
                 gemm_dtype: torch.dtype | None = None, hybrid: bool = True) -> None:
        self.scheme, self.source, self.device, self.dtype = scheme, source, device, dtype
        self.gemm_dtype, self.hybrid = gemm_dtype, hybrid
        quantized = take_quantized(state, scheme, source)
        layers = plan_layers(quantized, config, state)
        kernels = kernel_family(device)
        holdings = [Holding("dense", "--quantization none") if dense_only else holding_for(layer, kernels)
                    for layer in layers]
        self.held = [(layer, h) for layer, h in zip(layers, holdings) if h.kind != "dense"]
        dense = {s: w for layer, h in zip(layers, holdings) if h.kind == "dense"
                 for s, w in zip(layer.sources, layer.parts)}
        reasons = [h.reason for h in holdings if h.kind == "dense" and h.reason]
        if quantized:  # no fused layer takes them
            reasons.append(f"{next(iter(quantized))} and the like are not decoder projections kvpilot quantizes")
            dense.update(quantized)
        self._dequantize_into(state, dense, reasons)

    @property
    def quantization(self) -> str:
        """LoadedModel.quantization: the checkpoint's method while any layer stays quantized, else "none"."""
        return self.scheme.method if self.held else "none"

    def _dequantize_into(self, state: dict[str, torch.Tensor], dense: dict[str, QuantizedWeight],
                         reasons: list[str]) -> None:
        if not dense:
            return
        quantized_bytes = sum(w.nbytes for w in dense.values())
        dense_bytes = sum(w.out_features * w.in_features for w in dense.values()) * self.dtype.itemsize
        for module, weight in dense.items():
            state[f"{module}.weight"] = weight.dequantize(self.dtype)
        logger.warning("%s: %d of the checkpoint's %s-quantized linear layers are dequantized to %s at load (%s): "
                       "%.2f GiB instead of %.2f GiB, and every decode step reads them all", self.source, len(dense),
                       self.scheme.method, str(self.dtype).removeprefix("torch."), "; ".join(dict.fromkeys(reasons)),
                       dense_bytes / 2**30, quantized_bytes / 2**30)

    def prepare(self, model: nn.Module) -> None:
        """Puts a PendingLinear where each held layer goes (call on the meta-device model)."""
        for layer, _ in self.held:
            parent, name = _parent(model, layer.target)
            current = getattr(parent, name, None)
            if not isinstance(current, nn.Linear) or (current.out_features, current.in_features) != \
                    (layer.out_features, layer.in_features):
                raise ModelLoadError(f"{self.source}: quantized {', '.join(layer.sources)} ({layer.out_features} x "
                                     f"{layer.in_features}) do not fit the model's {layer.target} ({current}): "
                                     "config and weights do not match")
            setattr(parent, name, PendingLinear(layer.in_features, layer.out_features, layer.bias))

    def install(self, model: nn.Module) -> None:
        """Replaces the PendingLinear modules by the quantized layers (after model.load_weights)."""
        packed = [(layer, [to_blocks(p) for p in layer.parts]) for layer, h in self.held if h.kind == "packed"]
        modules = {layer.target: self._module(layer, h.kind, model) for layer, h in self.held if h.kind != "packed"}
        if packed:
            modules.update(self._packed_modules(model, packed))
        for target, module in modules.items():
            parent, name = _parent(model, target)
            setattr(parent, name, module)
        if packed:
            from kvpilot.model.quant.model_pack import release_packed_quants
            release_packed_quants(model, self.dtype)
        kinds = sorted({h.kind for _, h in self.held})
        if kinds:
            logger.info("%s: %d %s-quantized layers held as %s", self.source, len(self.held), self.scheme.method,
                        ", ".join(kinds))

    def _module(self, layer: FusedLayer, kind: str, model: nn.Module) -> nn.Module:
        bias = _pending_bias(model, layer.target)
        parts = [p.to(self.device) for p in layer.parts]
        if kind == "int4":
            return Int4Linear(parts, bias)
        if kind == "fp8-triton":
            return Fp8BlockLinear(parts, bias)
        fused = Fp8Weight.concat(parts)
        return Fp8Linear.from_quantized(fused.weight, fused.channel_scales(), bias)

    def _packed_modules(self, model: nn.Module, packed: list) -> dict[str, nn.Module]:
        """PackedLinear modules over the layers' blocks, built as the GGUF loader builds them (model_pack.py)."""
        from kvpilot.model.quant.kernel import best_isa
        from kvpilot.model.quant.linear import DenseScratch, PackedLinear
        from kvpilot.model.quant.model_pack import install_int8_gate, keeps_dense

        by_name = {f"{layer.target}.{i}": b for layer, blocks in packed for i, b in enumerate(blocks)}
        keep_dense = self.hybrid and keeps_dense("auto", self.dtype, by_name, psutil.virtual_memory().available,
                                                 self.gemm_dtype)
        gate, scratch, isa = install_int8_gate(model, self.dtype), DenseScratch(), best_isa()
        error = max((offset_error(p, b) for layer, blocks in packed for p, b in zip(layer.parts, blocks)),
                    default=0.0)
        if error:
            logger.info("%s: Q4_1 minimums rounded to float16 move weights by at most %.3g", self.source, error)
        modules: dict[str, nn.Module] = {}
        for layer, blocks in packed:
            bias = _pending_bias(model, layer.target)
            module = PackedLinear(blocks, bias is not None, scratch, isa, keep_dense=keep_dense,
                                  int8_activations=gate is not None, int8_gate=gate,
                                  bf16_gemm_dtype=self.gemm_dtype or torch.bfloat16)
            if bias is not None:
                module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
            modules[layer.target] = module
        return modules


def _parent(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    path, _, name = target.rpartition(".")
    return model.get_submodule(path), name


def _pending_bias(model: nn.Module, target: str) -> torch.Tensor | None:
    parent, name = _parent(model, target)
    pending = getattr(parent, name)
    if not isinstance(pending, PendingLinear):
        raise RuntimeError(f"{target} is not a pending pre-quantized layer")
    return pending.bias
