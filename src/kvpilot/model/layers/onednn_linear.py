"""OneDnnWeight: a bf16 linear weight held in oneDNN's blocked layout on CPU, reordered once at load (the
packed GGUF layers' dense copy, and OneDnnLinear: a dense bf16 model's decoder projections and untied output
layer).

`F.linear` on a plain bf16 weight runs oneDNN too, but reorders the weight into its blocked layout on every
call: an extra pass over every weight byte per GEMM, which dominates at few rows. SmolLM2-135M's four projection
shapes x 30 layers (2-vCPU Zen 4 EPYC, 2026-11-27), F.linear on the [in, out] layout (weight_layout.py) vs
prepacked: 16 rows 23.8 -> 18.3 ms, 64: 64.1 -> 43.1, 144: 82.0 -> 74.3, 512: 285.9 -> 278.1, 1,536: 820.7 ->
787.3. The products are bit for bit F.linear's (the same oneDNN kernels; checked at 1-1,536 rows on those shapes
and the output layer's, and in tests/model/test_onednn_linear.py).

The blocked tensor is opaque (no strides, no storage): `dense()` gives the plain values back, by a copy.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_bf16_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 GEMMs on `device` can take prepacked weights: a CPU torch built with oneDNN, on a CPU
    oneDNN runs bf16 on (AVX-512 at least)."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnWeight:
    """y = x @ W^T for bf16 x [M, in] and W [out, in]. Invariant: the result equals F.linear(x, W) exactly."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        # the batch-size hint only tunes the layout; measured rows 16-1,536 ran as fast with 1 as with 128 or 512
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] bf16 (+ bias [out], added inside the GEMM) -> [M, out] bf16."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    def dense(self) -> torch.Tensor:
        """The plain [out, in] bf16 values (a new tensor)."""
        return self.packed.to_dense()


class OneDnnLinear(nn.Module):
    """nn.Linear's forward on a OneDnnWeight, bias added inside the GEMM as F.linear does (bit for bit its
    result). `weight` gives the plain values back (a copy, for inspection)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.onednn = OneDnnWeight(linear.weight.detach())
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.onednn.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.onednn.linear(x.reshape(-1, self.in_features), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """As an output head (llama.py's logits): F.linear(x, W).float(), bit for bit."""
        return self(x).float()


@torch.no_grad()
def prepack_bf16_linears(model: nn.Module) -> int:
    """Replaces the bf16 nn.Linear layers of every decoder layer (`model.layers`) and an untied output layer
    (`lm_head`, then also the model's `output_head`) by OneDnnLinear where oneDNN takes them (a CPU model);
    returns how many. A tied output layer stays the embedding table (a prepacked copy would double it)."""
    count = 0
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and getattr(model, "output_head", None) is None \
            and onednn_bf16_applies(head.weight.dtype, head.weight.device):
        model.lm_head = model.output_head = OneDnnLinear(head)
        count += 1
    for layer in getattr(model, "layers", ()):
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and onednn_bf16_applies(child.weight.dtype, child.weight.device):
                    setattr(parent, name, OneDnnLinear(child))
                    count += 1
    return count
