"""Pre-quantized HF checkpoints: which scheme config.json's `quantization_config` declares, and whether
`--quantization` agrees with it (as vLLM resolves it).

Supported (what kvpilot runs; everything else is refused at load, naming this list):
- `awq`: 4 bits, GEMM packing (AutoAWQ's `version: gemm`), zero points, any group size;
- `gptq`: 4 bits, `checkpoint_format` gptq (v1: stored zero points are one less than used) or gptq_v2,
  symmetric or not, with or without act-order (`desc_act`, a `g_idx` per input column);
- `fp8`: float8 e4m3 weights with a per-tensor `weight_scale`, or 128x128-style blocks (`weight_block_size`,
  `weight_scale_inv`: Qwen's -FP8 and DeepSeek's layout);
- `compressed-tensors` (llm-compressor): `float-quantized` fp8 weights (strategy tensor, channel or block)
  and `pack-quantized` 4-bit weights (strategy group or channel, symmetric or not, act-order `weight_g_idx`).
Activation quantization a checkpoint declares is not reproduced: weights are what it stores, activations stay
in --dtype (CUDA fp8 layers quantize them per token, as `--quantization fp8` does).

Torch-free: a scheme is read from the config dict alone; which tensors hold it is checkpoint_tensors.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.model.errors import ModelLoadError

CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
# methods whose tensors the model family's own loader dequantizes (no scheme here): gpt-oss's MXFP4 experts
# (models/gpt_oss_weights.py)
FAMILY_DEQUANTIZED = ("mxfp4",)
SUPPORTED = ("awq (4-bit, GEMM packing), gptq (4-bit, gptq / gptq_v2 format, act-order or not), fp8 (per-tensor "
             "or block scales), compressed-tensors (float-quantized fp8: tensor / channel / block; "
             "pack-quantized 4-bit: group / channel)")


@dataclass(frozen=True)
class Int4Scheme:
    """4-bit integer weights in groups: w = (q - zero) * scale, q in 0..15.

    `layout` says how the checkpoint packs q and the zero points (int4_unpack.py): "awq", "gptq" or "pack"
    (compressed-tensors). `group_size` None: one group per output row. `zero_offset` is added to stored
    zero points (GPTQ v1 stores zero - 1). `symmetric` compressed-tensors weights store no zero points (8).
    """

    method: str
    layout: str
    group_size: int | None
    symmetric: bool
    zero_offset: int = 0
    act_order: bool = False

    @property
    def bits(self) -> float:
        return 4.0


@dataclass(frozen=True)
class Fp8Scheme:
    """float8 e4m3 weights with float32 scales: w = weight * scale, the scale indexed by (row // block[0],
    col // block[1]); `block` None: per tensor or per channel, told by each scale's shape.
    `scale_name`: the scale tensor's suffix (`weight_scale`, or `weight_scale_inv` for block layouts)."""

    method: str
    scale_name: str
    block: tuple[int, int] | None

    @property
    def bits(self) -> float:
        return 8.0


CheckpointScheme = Int4Scheme | Fp8Scheme


def read_checkpoint_scheme(hf_config: dict[str, Any], source: str) -> CheckpointScheme | None:
    """The scheme of config.json's `quantization_config`, None without one; ModelLoadError (naming what is
    supported) for a method or variant kvpilot does not run."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{source}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method in FAMILY_DEQUANTIZED:
        return None
    readers = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ModelLoadError(f"{source}: quantization_config.quant_method {method or None!r} is not supported; "
                             f"kvpilot loads {SUPPORTED}")
    return readers[method](qc, source)


def _refuse(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: {what} is not supported; kvpilot loads {SUPPORTED}")


def _group(value: Any, source: str) -> int | None:
    group = int(value if value is not None else -1)
    if group == -1:
        return None
    if group <= 0:
        raise _refuse(source, f"group_size {group}")
    return group


def _awq(qc: dict[str, Any], source: str) -> Int4Scheme:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    # the storage layout: `version` (AutoAWQ) or `format` (transformers 5, GPTQModel); a `backend` names a runtime
    # kernel, except llm-awq, whose own layout it implies
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if str(qc.get("backend", "")).lower() == "llm-awq":
        version = "llm-awq"
    if bits != 4:
        raise _refuse(source, f"awq with {bits} bits")
    if version != "gemm":
        raise _refuse(source, f"awq version {version!r} (only GEMM packing is read)")
    if not qc.get("zero_point", True):
        raise _refuse(source, "awq without zero points (zero_point: false)")
    return Int4Scheme("awq", "awq", _group(qc.get("group_size", qc.get("q_group_size")), source), symmetric=False)


def _gptq(qc: dict[str, Any], source: str) -> Int4Scheme:
    bits = int(qc.get("bits", 4))
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if bits != 4:
        raise _refuse(source, f"gptq with {bits} bits")
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise _refuse(source, f"gptq checkpoint_format {fmt!r}")
    return Int4Scheme("gptq", "gptq", _group(qc.get("group_size"), source), symmetric=bool(qc.get("sym", True)),
                      zero_offset=1 if fmt == "gptq" else 0, act_order=bool(qc.get("desc_act", False)))


def _fp8(qc: dict[str, Any], source: str) -> Fp8Scheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(source, f"fp8 format {fmt!r}")
    if qc.get("scale_fmt") not in (None, "float32"):  # ue8m0: MXFP8's power-of-two scales stored as bytes
        raise _refuse(source, f"fp8 scale_fmt {qc.get('scale_fmt')!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "weight_scale", None)
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise _refuse(source, f"fp8 weight_block_size {block!r}")
    return Fp8Scheme("fp8", "weight_scale_inv", (int(block[0]), int(block[1])))


def _compressed_tensors(qc: dict[str, Any], source: str) -> CheckpointScheme:
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if not weights:
        raise _refuse(source, "a compressed-tensors checkpoint without weight quantization (config_groups)")
    if any(w != weights[0] for w in weights):
        raise _refuse(source, "compressed-tensors with different weight schemes per config group")
    group_formats = [g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")]
    args, fmt = weights[0], str(qc.get("format") or (group_formats[0] if group_formats else "")).lower()
    if qc.get("sparsity_config"):
        raise _refuse(source, "compressed-tensors sparsity")
    kind, bits, strategy = str(args.get("type", "int")), int(args.get("num_bits", 8)), str(args.get("strategy"))
    if fmt == "float-quantized" and kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
        block = args.get("block_structure") if strategy == "block" else None
        if strategy == "block" and (not block or len(block) != 2):
            raise _refuse(source, f"compressed-tensors block_structure {block!r}")
        return Fp8Scheme("compressed-tensors", "weight_scale", tuple(int(b) for b in block) if block else None)
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy in ("group", "channel"):
        group = _group(args.get("group_size"), source) if strategy == "group" else None
        actorder = args.get("actorder") not in (None, False, "static")
        return Int4Scheme("compressed-tensors", "pack", group, symmetric=bool(args.get("symmetric", True)),
                          act_order=actorder)
    raise _refuse(source, f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights, strategy "
                          f"{strategy!r}")


def resolve_checkpoint_quantization(requested: str, scheme: CheckpointScheme | None,
                                    source: str) -> CheckpointScheme | None:
    """The checkpoint's scheme, which `--quantization requested` accepts as auto, as its method's name, or as
    none (the caller then dequantizes every quantized layer at load). Any other value contradicts the
    checkpoint: a ModelLoadError, as is naming a checkpoint method for a checkpoint without one."""
    if scheme is None:
        if requested in ("awq", "gptq", "compressed-tensors"):
            raise ModelLoadError(f"{source}: --quantization {requested} reads pre-quantized checkpoints, and this "
                                 "one has no quantization_config; use --quantization int4 (CPU) or fp8 (GPU) to "
                                 "quantize at load, or auto")
        return None
    if requested in ("auto", scheme.method, "none"):
        return scheme
    raise ModelLoadError(f"{source} is a pre-quantized {scheme.method} checkpoint (config.json quantization_config): "
                         f"--quantization {requested} contradicts it; use --quantization auto (or "
                         f"{scheme.method}), or none to dequantize its weights at load")
