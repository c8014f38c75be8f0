"""RoPE rotation angles per position for every frequency scaling kvpilot runs: none, llama3, linear, dynamic
(NTK), yarn and longrope, in float32 and in HF transformers' order of operations (modeling_rope_utils), so
that the cos/sin tables hold HF's values.

A paged server looks every token's angles up in one position table shared by all requests: a position has one
encoding, whichever request it belongs to (its keys are cached per position and shared by prefix caching).
Two HF types instead pick frequencies from the length of the sequence in the forward pass; kvpilot applies
them per position, which is what HF itself computes when it decodes one token at a time:

- longrope (Phi-3/4): position p uses `long_factor` when p >= original_max_position_embeddings (the
  threshold), `short_factor` below. HF uses `long_factor` for every position of a forward pass whose last
  position is at or past the threshold. So a request whose prompt ends below the threshold matches HF exactly,
  however far its generation runs (HF then encodes each new token, and only it, with `long_factor`; the keys
  it cached keep `short_factor`). A prompt that reaches past the threshold differs: HF encodes all of it,
  including its first threshold positions, with `long_factor`; kvpilot those first positions with
  `short_factor`.
- dynamic (NTK): position p uses the base HF computes for a sequence of max(p + 1, L) tokens (L: the config's
  max_position_embeddings). Exact for prompts within L likewise; a longer prompt's positions each get their
  own base where HF uses the whole prompt's length for all of them.
"""

from __future__ import annotations

import math

import torch

from kvpilot.model.config import RopeScaling


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Plain RoPE: pair i turns at theta ** (-2i / dim) radians per position ([dim // 2] float32)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(theta: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    inv_freq = default_inv_freq(theta, dim)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The config's attention_factor, else DeepSeek's mscale ratio where both mscales are set, else the
    YaRN paper's 0.1 ln(factor) + 1."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def yarn_inv_freq(theta: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: pairs that turn more than beta_fast times over the original context keep their frequency
    (extrapolation), pairs turning fewer than beta_slow times are divided by `factor` (interpolation), a
    linear ramp over the pair index blends the ones between."""
    original = scaling.original_max_position_embeddings

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp  # the weight of the unscaled frequency (HF's order of operations, for equal roundings)
    return interpolation * (1 - keep) + extrapolation * keep


def longrope_attention_factor(scaling: RopeScaling) -> float:
    """The config's attention_factor, else sqrt(1 + ln(factor) / ln(original length)) (1 without scaling)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


def longrope_inv_freq(theta: float, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE: each pair's plain frequency divided by its own factor (short_factor or long_factor)."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)


def dynamic_inv_freq(theta: float, dim: int, scaling: RopeScaling, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK, [len(positions), dim // 2]: position p's frequencies with the base HF uses for a sequence
    of max(p + 1, L) tokens, L = original_max_position_embeddings (the plain frequencies below L)."""
    length, factor = scaling.original_max_position_embeddings, scaling.factor
    inv_freq = default_inv_freq(theta, dim).repeat(len(positions), 1)
    beyond = positions >= length
    if bool(beyond.any()):
        seq_len = positions[beyond] + 1
        stretch = (factor * seq_len / length) - (factor - 1)  # float32, as HF's
        # HF raises one 0-d tensor at a time, which rounds as the float64 power rounded to float32 does (the
        # vectorized float32 power differs in the last bit now and then)
        base = theta * (stretch.double() ** (dim / (dim - 2))).float()
        inv_freq[beyond] = 1.0 / (base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq


def rotary_angles(theta: float, dim: int, scaling: RopeScaling | None,
                  num_positions: int) -> tuple[torch.Tensor, float]:
    """(angles, attention_factor): position p rotates pair i of the first `dim` dimensions of a head by
    angles[p, i] radians ([num_positions, dim // 2] float32); cos and sin are multiplied by
    attention_factor (yarn and longrope; 1.0 otherwise). See the module docstring for the per-position rule
    of longrope and dynamic."""
    positions = torch.arange(num_positions, dtype=torch.int64)
    kind = scaling.rope_type if scaling is not None else None
    attention_factor = 1.0
    if scaling is None:
        inv_freq = default_inv_freq(theta, dim)
    elif kind == "llama3":
        inv_freq = llama3_inv_freq(theta, dim, scaling)
    elif kind == "linear":
        inv_freq = default_inv_freq(theta, dim) / scaling.factor
    elif kind == "yarn":
        inv_freq, attention_factor = yarn_inv_freq(theta, dim, scaling), yarn_attention_factor(scaling)
    elif kind == "longrope":
        short = longrope_inv_freq(theta, dim, scaling.short_factor)
        long = longrope_inv_freq(theta, dim, scaling.long_factor)
        inv_freq = torch.where((positions >= scaling.original_max_position_embeddings)[:, None], long, short)
        attention_factor = longrope_attention_factor(scaling)
    elif kind == "dynamic":
        inv_freq = dynamic_inv_freq(theta, dim, scaling, positions)
    else:
        raise ValueError(f"rope scaling type {kind!r} has no implementation")  # config.py refuses it first
    return positions.float()[:, None] * inv_freq, attention_factor
