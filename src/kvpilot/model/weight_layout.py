"""Re-lays linear weights in memory for the CPU GEMM kernels (same values, shapes and names).

nn.Linear computes x @ W^T with W stored [out, in]: the BLAS then multiplies by a transposed B, which on
this CPU's MKL runs 2-8x slower for the 8-48-row inputs of decode steps (measured, docs/benchmark-log.md)
than the same product with B stored [in, out]. Storing W^T contiguous and keeping W as its transposed
view gives F.linear a plain B at every size, with no change to the modules or their forward.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def relayout_linear_weights(model: nn.Module) -> int:
    """Makes every float32 (or other non-bf16) nn.Linear weight a [out, in] view of a contiguous [in, out] tensor;
    returns how many.

    Invariant: values, shapes, dtypes and parameter names are unchanged (state_dict and load_weights still
    work); only strides differ. Meant for CPU; GPUs' BLAS handles either layout at full speed.
    """
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    output = getattr(model, "output_weight", None)
    table = output() if callable(output) else None  # None: the output projection is packed
    # A tied output projection is the embedding table: one tensor, both uses. With a packed output head
    # (output_head) the table is mostly a lookup table and stays row-major: transposed, the lookup read every
    # value of a row from another cache line (~0.2 ms a 16-token step, ~5 ms a 1,536-token one).
    if table is not None and getattr(model, "output_head", None) is None:
        weights.append(table)
    count = 0
    for weight in weights:
        # bf16 GEMMs run in oneDNN, which reads either layout and computes the same sums; [in, out] made a
        # vocabulary-wide output layer slower there (docs/benchmark-log.md, "Figures moved out of the code")
        if weight.dim() == 2 and weight.is_contiguous() and weight.dtype != torch.bfloat16:
            weight.data = weight.data.t().contiguous().t()
            count += 1
    return count
