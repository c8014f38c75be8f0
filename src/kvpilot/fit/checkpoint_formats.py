"""Bits a weight of a pre-quantized HF checkpoint takes in kvpilot's memory, from config.json's
`quantization_config` (AWQ, GPTQ, FP8, compressed-tensors), as kvpilot's loader holds it (model/quant/
checkpoint_layers.py):

- 4-bit groups (AWQ, GPTQ, compressed-tensors pack-quantized), GPU: the checkpoint's own tensors for the Triton
  kernel: 4 bits + a 16-bit scale per group (+ a 4-bit zero point per group where stored: AWQ and GPTQ always,
  compressed-tensors unless symmetric); group 128 with zeros: 4 + 20/128 = 4.156 bits.
- 4-bit groups, CPU: regrouped into GGUF blocks of 32 for the packed kernels, Q4_0 (symmetric: 4.5 bits) or Q4_1
  (with zero points: 5.0 bits); groups that are not whole blocks or act-order (`desc_act`, `actorder`) layers whose
  groups cut through blocks are dequantized at load (16 bits in bf16).
- fp8 (e4m3), GPU: 8 bits + one fp32 scale per block (128x128: 32/16384 = 0.002 bits), per row or per tensor
  (negligible); CPU: dequantized at load to the compute dtype.
Embeddings, the output head, norms and biases stay in the compute dtype either way (a quantized head is dequantized).
"""

from __future__ import annotations

from typing import Any

CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")


def _int4(group: int | None, zeros: bool, symmetric: bool, act_order: bool, on_gpu: bool, compute_bits: int,
          method: str) -> tuple[str, float, str]:
    """`zeros`: the checkpoint stores zero points (GPTQ does even when symmetric); `symmetric`: every zero is 8."""
    label = f"{method} int4 " + (f"g{group}" if group else "per channel") + (" act-order" if act_order else "")
    if on_gpu:
        per_group = group or 4096  # one group a row: its width, about
        bits = 4 + (16 + (4 if zeros else 0)) / per_group
        return label, bits, f"{label}: 4-bit weights with a 16-bit scale{' and 4-bit zero' if zeros else ''} per group"
    if act_order or (group is not None and group % 32):
        why = "act-order groups" if act_order else f"groups of {group}"
        return label, compute_bits, f"{label}: {why} do not map onto kvpilot's CPU blocks of 32: dequantized at load"
    block = "Q4_0 (scale)" if symmetric else "Q4_1 (scale and minimum)"
    return label, 4.5 if symmetric else 5.0, f"{label}: held as GGUF {block} blocks of 32 by kvpilot's CPU kernels"


def _fp8(block: Any, on_gpu: bool, compute_bits: int, method: str) -> tuple[str, float, str]:
    if not on_gpu:
        return "fp8 dequantized", compute_bits, f"{method} fp8 weights are dequantized at load on a CPU"
    scale_bits = 32 / (int(block[0]) * int(block[1])) if block else 0.0
    return "fp8", 8 + scale_bits, f"{method} fp8 weights: 8 bits" + (
        f" + an fp32 scale per {block[0]}x{block[1]} block" if block else " with per-tensor or per-row scales")


def checkpoint_linear_bits(qc: dict[str, Any], on_gpu: bool, compute_bits: int) -> tuple[str, float, str]:
    """(format name, bits a linear weight takes in kvpilot's memory, what holds them) for a quantization_config."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return _int4(group if group > 0 else None, True, False, False, on_gpu, compute_bits, "awq")
    if method == "gptq":
        group = int(qc.get("group_size", 128))
        return _int4(group if group > 0 else None, True, bool(qc.get("sym", True)), bool(qc.get("desc_act")), on_gpu,
                     compute_bits, "gptq")
    if method == "fp8":
        return _fp8(qc.get("weight_block_size"), on_gpu, compute_bits, "fp8")
    if method == "compressed-tensors":
        groups = [g.get("weights") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        weights = next((w for w in groups if w), None) or {}
        if weights.get("type") == "float":
            return _fp8(weights.get("block_structure"), on_gpu, compute_bits, method)
        group = weights.get("group_size") if weights.get("strategy") == "group" else None
        act_order = weights.get("actorder") not in (None, False, "static")
        symmetric = bool(weights.get("symmetric", True))
        return _int4(int(group) if group else None, not symmetric, symmetric, act_order, on_gpu, compute_bits, method)
    # gpt-oss's mxfp4 experts are dequantized at load on a GPU (on a CPU they stay packed: fit.weights); other methods
    # kvpilot refuses to load
    return method, compute_bits, (f"{method} weights are dequantized at load" if method == "mxfp4" else
                                  f"kvpilot does not load {method} checkpoints (it loads "
                                  f"{', '.join(CHECKPOINT_METHODS)}): sized dequantized")
