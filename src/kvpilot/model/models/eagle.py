"""EAGLE draft heads (speculative_config method "eagle" or "eagle3"): one decoder layer that drafts from the
target's hidden states, loaded from a checkpoint in the layouts vLLM reads.

EAGLE-1 (`"eagle"`): `fc` [H, 2H] (optional bias) over [embedding of token p+1, the target's last hidden state
at position p (after its final norm)], then one Llama decoder layer `layers.0.*` whose input norm is skipped;
its output (no norm) is both the next position's hidden input and, through the target's own lm_head, the
draft's logits. The embedding is the target's (a checkpoint's own `embed_tokens.weight` is used if present).

EAGLE-3 (`"eagle3"`): `fc` [H, 3H] over three of the target's hidden states (the inputs of its layers
`eagle_aux_hidden_state_layer_ids`, default (2, L // 2, L - 3): the residual stream before those layers), which
gives the first hidden input; `midlayer.*` is a decoder layer whose attention reads
[input_layernorm(embedding), hidden_norm(hidden)] (2H wide, so q/k/v_proj are [*, 2H]) with the hidden input
as the residual; `norm` then its own `lm_head` over a draft vocabulary, whose id i is target id i + d2t[i]
(`d2t`; `t2d` is not needed). The hidden fed forward is the layer's output before `norm`.

The head runs in a ModelRunner of its own (model/eagle_proposer.py), like any model: forward(token_ids,
positions, kv_caches, attn) with the hidden inputs handed over beforehand in `input_hidden` ([T, H], one per
token, already through `fc` for EAGLE-3's target states: `combine`), and the hidden states to feed forward
left in `last_hidden`. The target's modules are referenced, not registered (they are the target's weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.attention.base import StepAttention
from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.layers.norm import RMSNorm
from kvpilot.model.layers.rope import RotaryEmbedding
from kvpilot.model.models.llama import (Attention, DecoderLayer, LlamaForCausalLM, copy_fused_weights,
                                        fuse_hf_state_dict)

KINDS = ("eagle", "eagle3")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: the inputs of layers 2, L // 2 and L - 3 (each clamped into 1 .. L - 1)."""
    return tuple(min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class EagleLayout:
    """What a head's weights say about it: kind, its hidden size, fc's input width, fc's bias, the draft
    vocabulary (EAGLE-3's lm_head rows; None: the target's head), whether it brings its own embedding."""

    kind: str
    hidden_size: int
    fc_in: int
    fc_bias: bool
    draft_vocab: int | None
    own_embedding: bool


def read_layout(kind: str, state: dict[str, torch.Tensor], source: str) -> EagleLayout:
    """The head's layout from its weights (names without a leading "model."); ModelLoadError when they are
    not an EAGLE head of this kind."""
    fc = state.get("fc.weight")
    layer = "layers.0." if kind == "eagle" else "midlayer."
    if fc is None or fc.dim() != 2 or not any(k.startswith(layer) for k in state):
        raise ModelLoadError(f"{source}: not an {'EAGLE-1' if kind == 'eagle' else 'EAGLE-3'} head: it needs "
                             f"fc.weight and {layer}* weights (method {kind!r})")
    draft_vocab = None
    if kind == "eagle3":
        head = state.get("lm_head.weight")
        if head is None or head.dim() != 2:
            raise ModelLoadError(f"{source}: an EAGLE-3 head needs lm_head.weight")
        draft_vocab = int(head.shape[0])
    return EagleLayout(kind, int(fc.shape[0]), int(fc.shape[1]), "fc.bias" in state, draft_vocab,
                       "embed_tokens.weight" in state)


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding), hidden_norm(hidden)]."""

    supports_deferred_add = False

    def __init__(self, config: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__(config, 0)
        attn = self.self_attn
        assert isinstance(attn, Attention)
        attn.qkv_proj = nn.Linear(2 * config.hidden_size, attn.q_size + 2 * attn.kv_size, bias=config.attention_bias)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward_eagle(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, attn: StepAttention) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin,
                                      kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """An EAGLE head over `target` (module docstring). config: the head's (one layer; vocab_size the target's)."""

    def __init__(self, config: ModelConfig, layout: EagleLayout, target: LlamaForCausalLM, max_positions: int,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        self.config = config
        self.kind = layout.kind
        self._target = (target,)  # a tuple: not registered, its weights stay the target's
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, _weight=torch.empty(config.vocab_size, hidden)) \
            if layout.own_embedding else None
        self.fc = nn.Linear(layout.fc_in, hidden, bias=layout.fc_bias)
        if self.kind == "eagle":
            layer = DecoderLayer(config, 0)
            layer.input_layernorm = nn.Identity()  # EAGLE-1's first layer has no input norm
            self.norm = None
            self.lm_head = None
        else:
            layer = Eagle3Layer(config, norm_before_residual)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            assert layout.draft_vocab is not None
            self.lm_head = nn.Linear(hidden, layout.draft_vocab, bias=False)
            self.register_buffer("draft_to_target", torch.zeros(layout.draft_vocab, dtype=torch.long))
        self.layers = nn.ModuleList([layer])
        self.rotary = RotaryEmbedding(config, max_positions)
        self.input_hidden: torch.Tensor | None = None  # set before each forward (the proposer)
        self.last_hidden: torch.Tensor | None = None  # left by each forward: the hidden states to feed forward

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The target's states at some positions -> the head's hidden inputs there: EAGLE-3's fc over the three
        aux states; EAGLE-1's are the states themselves (its fc mixes them with the embedding, every token)."""
        return self.fc(target_states) if self.kind == "eagle3" else target_states

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids) if self.embed_tokens is not None else self.target.embed(token_ids)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: StepAttention) -> torch.Tensor:
        hidden = self.input_hidden
        if hidden is None or hidden.shape[0] != token_ids.shape[0]:
            raise RuntimeError("EagleHead.forward needs input_hidden: one hidden state per token")
        embeds = self.embed(token_ids)
        cos, sin = self.rotary.tables(positions, embeds.dtype)
        layer = self.layers[0]
        if self.kind == "eagle":
            x = layer(self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1)), cos, sin, kv_caches[0], attn)
            self.last_hidden = x
            return x
        x = layer.forward_eagle(embeds, hidden.to(embeds.dtype), cos, sin, kv_caches[0], attn)
        self.last_hidden = x
        assert self.norm is not None
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, target vocab] float32: EAGLE-1 through the target's head; EAGLE-3 through its own, each draft id
        at its target id (-inf at target ids the draft vocabulary lacks)."""
        if self.lm_head is None:
            return self.target.logits(hidden)
        draft = F.linear(hidden, self.lm_head.weight).float()
        out = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = draft
        return out

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.lm_head is None:
            return self.target.greedy_ids(hidden)
        return self.draft_to_target[F.linear(hidden, self.lm_head.weight).argmax(dim=-1)]

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor], source: str) -> None:
        """The checkpoint's names (vLLM's: EAGLE-1 `fc`, `layers.0.*`; EAGLE-3 `fc`, `midlayer.*`, `norm`,
        `lm_head`, `d2t`) -> this module's; every parameter present and right-shaped."""
        state = dict(state)
        d2t = state.pop("d2t", None)
        state.pop("t2d", None)
        state = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in state.items()}
        if self.kind == "eagle":
            state.pop("layers.0.input_layernorm.weight", None)  # trained checkpoints carry one; EAGLE-1 skips it
            state.pop("norm.weight", None)
        copy_fused_weights(self, fuse_hf_state_dict(state, self.config), source, f"an {self.kind} head")
        if self.kind == "eagle3":
            size = self.draft_to_target.shape[0]
            offsets = torch.zeros(size, dtype=torch.long) if d2t is None else d2t.to(torch.long).cpu()
            if tuple(offsets.shape) != (size,):
                raise ModelLoadError(f"{source}: d2t has shape {tuple(offsets.shape)}, lm_head has {size} rows")
            targets = torch.arange(size) + offsets
            if int(targets.min()) < 0 or int(targets.max()) >= self.config.vocab_size:
                raise ModelLoadError(f"{source}: d2t maps draft ids to target ids outside 0 .. "
                                     f"{self.config.vocab_size - 1}: the head was trained for another vocabulary")
            self.draft_to_target.copy_(targets.to(self.draft_to_target.device))


def load_head_state(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors by name (a leading "model." dropped): *.safetensors, else pytorch_model.bin (the form
    some EAGLE-1 heads are published in)."""
    from kvpilot.model.hf_dir import load_safetensors_state_dict

    if any(directory.glob("*.safetensors")):
        state = load_safetensors_state_dict(directory)
    elif (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{directory}: no *.safetensors or pytorch_model.bin")
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
