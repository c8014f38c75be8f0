"""gpt-oss expert weights, from either checkpoint layout into layers.moe.Experts' layout.

The two layouts of `model.layers.{i}.mlp.experts.*` (transformers' models/gpt_oss and integrations/mxfp4.py):
  - OpenAI's released checkpoints (config.json `quantization_config.quant_method: mxfp4`): `gate_up_proj_blocks`
    uint8 [E, 2I, H/32, 16] with `gate_up_proj_scales` uint8 [E, 2I, H/32], and `down_proj_blocks`
    [E, H, I/32, 16] with `down_proj_scales` [E, H, I/32]: rows are outputs, each row's inputs in blocks of 32
    FP4 (e2m1) values, two a byte (value 2k of a block in byte k's low nibble, 2k+1 in its high nibble), times
    the block's E8M0 scale 2**(scale - 127);
  - transformers' save_pretrained (dequantized): `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], inputs
    first (x @ W).
Both beside `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H]. In either, gate and up alternate along
2I (gate j at 2j, up j at 2j + 1); Experts holds every gate row first, then every up row, so they are
de-interleaved here (the biases too).

On a CPU (`--quantization auto`) MXFP4 experts stay packed: their bytes rewritten as GGUF's MXFP4 blocks
(take_mxfp4_expert_blocks) for PackedExperts, 4.25 bits a weight. Otherwise (a GPU, `--quantization none`) they are
dequantized straight into the model's parameters, one expert at a time, in the model's dtype (a whole dequantized
copy beside the parameters would double the load's peak memory): 16 bits a weight in bf16 (logged at load).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.moe import Experts
from kvpilot.model.quant.formats import MXFP4
from kvpilot.model.quant.packed_experts import STACKED_NAME, ExpertBlocks

logger = logging.getLogger(__name__)

# the 16 FP4 e2m1 codes (sign bit 3, two exponent bits, one mantissa bit): OCP Microscaling, as transformers
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale
E8M0_BIAS = 127
PROJECTIONS = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and E8M0 scales [..., G] -> [..., G * 32] in `dtype`, on blocks' device
    (exact: every FP4 value times a power of two is a bf16 / float32 number, short of overflow)."""
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         f"blocks need [..., G, {MXFP4_BLOCK // 2}] bytes beside [..., G] scales")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).int()  # low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32).sub_(E8M0_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponents).to(dtype).flatten(-2)


def deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """Alternating gate/up entries along `dim` -> every gate entry, then every up entry (a new tensor)."""
    size = gate_up.shape[dim]
    order = torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)]).to(gate_up.device)
    return gate_up.index_select(dim, order)


def load_mxfp4_experts(state: dict[str, torch.Tensor], prefix: str, experts: Experts) -> bool:
    """Pops `prefix`.{gate_up_proj,down_proj}_{blocks,scales} from `state` and dequantizes them into
    `experts`' weights (gate/up de-interleaved); False (nothing done) when the layer has none, ModelLoadError
    when it has some but not all, or of the wrong shapes (the caller names the checkpoint)."""
    names = [f"{prefix}.{proj}_{part}" for proj in PROJECTIONS for part in ("blocks", "scales")]
    present = [name for name in names if name in state]
    if not present:
        return False
    if len(present) < len(names):
        missing = sorted(set(names) - set(present))
        raise ModelLoadError(f"missing MXFP4 expert tensors {missing}: the checkpoint is incomplete")
    for proj in PROJECTIONS:
        blocks, scales = state.pop(f"{prefix}.{proj}_blocks"), state.pop(f"{prefix}.{proj}_scales")
        param = getattr(experts, proj)
        rows, cols = param.shape[1:]
        expected = (experts.num_experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        if tuple(blocks.shape) != expected or tuple(scales.shape) != expected[:3]:
            raise ModelLoadError(f"{prefix}.{proj}_blocks / _scales have shapes {tuple(blocks.shape)} / "
                                 f"{tuple(scales.shape)} but the config implies {expected} / {expected[:3]}: config "
                                 "and weights do not match")
        with torch.no_grad():
            for expert in range(experts.num_experts):
                weight = dequantize_mxfp4(blocks[expert].to(param.device), scales[expert].to(param.device),
                                          param.dtype)
                param[expert].copy_(deinterleave(weight, 0) if proj == "gate_up_proj" else weight)
    return True


def convert_dense_experts(state: dict[str, torch.Tensor], prefix: str) -> None:
    """save_pretrained's `prefix`.gate_up_proj [E, H, 2I] and down_proj [E, I, H], and the gate_up bias of either
    layout, into Experts' layout, in place; the names stay (they are Experts' own). Leaves what is absent."""
    gate_up = state.get(f"{prefix}.gate_up_proj")
    if gate_up is not None:
        state[f"{prefix}.gate_up_proj"] = deinterleave(gate_up.transpose(1, 2), 1)
    down = state.get(f"{prefix}.down_proj")
    if down is not None:
        state[f"{prefix}.down_proj"] = down.transpose(1, 2)
    bias = state.get(f"{prefix}.gate_up_proj_bias")
    if bias is not None:
        state[f"{prefix}.gate_up_proj_bias"] = deinterleave(bias, 1)


def stack_gguf_expert_biases(state: dict[str, torch.Tensor], prefix: str) -> None:
    """A GGUF's `prefix`.{gate,up,down}_exps.bias (llama.cpp's converter splits the interleaved gate/up: gate and
    up [E, I], down [E, H]) into Experts' gate_up_proj_bias [E, 2I] and down_proj_bias, in place (their weights:
    moe_decoder.stack_experts); leaves a state without them as it is."""
    gate, up = state.pop(f"{prefix}.gate_exps.bias", None), state.pop(f"{prefix}.up_exps.bias", None)
    if gate is not None and up is not None:
        state[f"{prefix}.gate_up_proj_bias"] = torch.cat([gate, up], dim=1)
    down = state.pop(f"{prefix}.down_exps.bias", None)
    if down is not None:
        state[f"{prefix}.down_proj_bias"] = down


def _gguf_mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 rows (blocks uint8 [R, G, 16]: value 2k in byte k's low nibble, 2k + 1 in its high one;
    scales [R, G]) as GGUF's MXFP4 blocks [R, G * 17]: the exponent byte (the same 2^(s - 127) scale: ggml halves
    it and doubles the table), then byte j holding value j low and value j + 16 high."""
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    return np.concatenate([scales[..., None], nibbles], axis=-1).reshape(blocks.shape[0], -1)


def take_mxfp4_expert_blocks(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, ExpertBlocks]:
    """OpenAI's MXFP4 experts as the packed loader's ExpertBlocks (quant/packed_experts.py names: gate, up and down
    of every layer, gate and up de-interleaved), their `_blocks` / `_scales` popped from `state`. Nothing is taken
    (an empty dict) unless every layer has all four tensors: load_mxfp4_experts then dequantizes them, or names
    what is missing."""
    names = [f"model.layers.{i}.mlp.experts.{proj}_{part}" for i in range(num_layers) for proj in PROJECTIONS
             for part in ("blocks", "scales")]
    if not all(name in state for name in names):
        return {}
    packed: dict[str, ExpertBlocks] = {}
    for i in range(num_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        for proj in PROJECTIONS:
            blocks = state.pop(f"{prefix}.{proj}_blocks").contiguous().numpy()
            scales = state.pop(f"{prefix}.{proj}_scales").contiguous().numpy()
            num_experts = blocks.shape[0]
            parts = {"gate": np.s_[:, 0::2], "up": np.s_[:, 1::2]} if proj == "gate_up_proj" else {"down": np.s_[:]}
            for kind, rows in parts.items():
                b, s = blocks[rows], scales[rows]
                raw = _gguf_mxfp4_rows(b.reshape(-1, *b.shape[2:]), s.reshape(-1, s.shape[-1]))
                packed[STACKED_NAME.format(layer=i, kind=kind)] = ExpertBlocks.stacked(raw, MXFP4, num_experts)
    return packed


def log_dequantized_memory(model: torch.nn.Module, state_bytes: int, source: str) -> None:
    """One log line: the MXFP4 experts' bytes in the checkpoint against their dequantized bytes in memory."""
    dense = sum(getattr(module, proj).nbytes for module in model.modules() if isinstance(module, Experts)
                for proj in PROJECTIONS)
    dtype = next(module for module in model.modules() if isinstance(module, Experts)).gate_up_proj.dtype
    logger.warning("%s: MXFP4 experts dequantized to %s at load (kvpilot has no MXFP4 kernel yet): %.1f MiB in "
                   "the checkpoint, %.1f MiB in memory", source, str(dtype).removeprefix("torch."),
                   state_bytes / 2**20, dense / 2**20)
