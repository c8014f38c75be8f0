"""`--quantization fp8`: the decoder layers' linear weights quantized at load to float8 e4m3 with one scale
per output channel, and activations quantized per token on the fly (vLLM's dynamic fp8). Each projection is
then one `torch._scaled_mm`: Hopper's and Ada's fp8 tensor cores at twice the bf16 rate, reading half the
weight bytes (what bounds decode). Works for real and dummy weights. The embedding and output layers stay in
--dtype, as in vLLM. CPU torch runs the same op (slowly): the tests check the arithmetic there.

Numerics: w ~= w_q * s_w[n] with s_w = max|w[n, :]| / 448; x ~= x_q * s_x[t] likewise per token; the
product accumulates in float32 and is scaled once per output element.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.gpu_small_ops import small_ops_for

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] -> (e4m3 [R, K], float32 scales [R, 1]) with values ~= q * scale, per row."""
    values32 = values.float()
    scale = (values32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (values32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as e4m3 [N, K] and per-channel scales; x [T, K] in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self._hold(*quantize_rows(weight.detach()), bias)

    @classmethod
    def from_quantized(cls, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        """A layer over weights already in e4m3 [N, K] with float32 scales [N] (an fp8 checkpoint's)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weight_fp8, scale.to(torch.float32), bias)
        return layer

    def _hold(self, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = quantized.shape
        self.register_buffer("weight_fp8", quantized)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty((*shape[:-1], self.out_features))
        gpu = small_ops_for(rows) if rows.stride(-1) == 1 else None  # CUDA: one Triton kernel
        x_q, x_scale = gpu.quantize_rows_fp8(rows, FP8_MAX, MIN_SCALE) if gpu is not None else quantize_rows(rows)
        # CUDA's row-wise scaled matmul writes bfloat16 only
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
        out = torch._scaled_mm(x_q, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                               out_dtype=out_dtype).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the layer computes with (for error bounds)."""
        return self.weight_fp8.float() * self.weight_scale.reshape(-1, 1)


def check_fp8_device(device: torch.device) -> None:
    """ModelLoadError on a GPU without fp8 tensor cores (before compute capability 8.9)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ModelLoadError("--quantization fp8 needs fp8 tensor cores (compute capability 8.9 or newer: Ada, "
                             "Hopper); use --quantization none")


@torch.no_grad()
def quantize_fp8_layers(model: nn.Module) -> None:
    """Replaces every decoder layer's qkv, output, gate/up and down projections by Fp8Linear; frees the
    dense weights. Input features must be multiples of 16 (the fp8 matmul's tile)."""
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            if linear.in_features % 16 or linear.out_features % 16:
                raise ModelLoadError(f"--quantization fp8 needs layer sizes that are multiples of 16; {name} is "
                                     f"{linear.out_features} x {linear.in_features}: use --quantization none")
            setattr(parent, name, Fp8Linear(linear.weight, linear.bias))
