"""The shared decoder: Llama 2/3, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM; the
base the other families' files build on.

Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); `load_weights` takes
an HF-named state dict and fuses it, checking every shape against the config.

Seams for other families (each overridable in a subclass): `DecoderLayer.attention_class` and `make_mlp`
(the per-layer modules), `LlamaForCausalLM.layer_class`, `embed` (input scaling), `logits` (soft-capping),
and `hf_state_dict` (HF names -> module names). A layer class whose forward differs from the pre-norm
residual pattern sets `supports_deferred_add = False` (the fused add+norm loop, CUDA or bf16 CPU, then runs
forward()).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.model.config import ModelConfig
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.attention.base import LayerAttention, StepAttention
from kvpilot.model.layers.cpu_bf16_ops import bf16_ops_for, residual_ops_for
from kvpilot.model.layers.gpu_small_ops import small_ops_for
from kvpilot.model.layers.norm import RMSNorm
from kvpilot.model.layers.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from kvpilot.model.fused_decode import FusedDecode
    from kvpilot.model.quant.linear import Int8Gate


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.sliding_window = config.layer_window(layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        self.layer_attention = LayerAttention(self.scale, sliding_window=self.sliding_window,
                                              kv_group=config.layer_kv_group(layer_idx))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn: StepAttention) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k heads are adjacent: rotate them in one pass (half the small ops)
            qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        elif (gpu := _fused_qk_ops(qk, cos, self.q_norm.weight)) is not None:  # CUDA: norms and rotary in one kernel
            qk = gpu.qk_norm_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                                    self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.view(-1, self.num_heads, self.head_dim)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        out = attn(q, k, v, kv_cache, self.layer_attention)
        return self.o_proj(out.reshape(-1, self.q_size))


def _fused_qk_ops(qk: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor) -> Any | None:
    """The Triton ops when q/k norms and rotary can run as one kernel (CUDA, unit stride, matching dtypes, the
    whole head rotating)."""
    gpu = small_ops_for(qk)
    if gpu is None or qk.stride(-1) != 1 or not (cos.dtype == qk.dtype == weight.dtype):
        return None
    if cos.shape[-1] != weight.shape[0]:  # partial rotary: the kernel rotates whole heads
        return None
    return gpu


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = bf16_ops_for(gate_up) if gate_up.dim() == 2 else None
        if ops is not None:  # bf16 on CPU: one C++ pass (and the fused decode's own op)
            return self.down_proj(ops.silu_mul_bf16(gate_up))
        gpu = small_ops_for(gate_up) if gate_up.dim() == 2 and gate_up.stride(-1) == 1 else None
        if gpu is not None:  # CUDA: one Triton kernel
            return self.down_proj(gpu.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one temporary fewer


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention
    supports_deferred_add = True  # forward_deferred_add below computes forward() (the residual fusion)

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                attn: StepAttention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_deferred_add(self, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                             sin: torch.Tensor, kv_cache: torch.Tensor, attn: StepAttention,
                             fused: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with each residual add done by `fused`'s kernel of the norm after it (Triton on CUDA, C++ for
        bf16 rows on CPU): takes and returns (delta, residual) whose sum is the hidden state (residual None: delta
        is the whole state, the first layer's input); bit for bit forward()'s sums and norms."""
        if residual is None:
            residual, normed = delta, self.input_layernorm(delta)
        else:
            residual, normed = fused.add_rms_norm(delta, residual, self.input_layernorm.weight,
                                                  self.input_layernorm.eps)
        attn_out = self.self_attn(normed, cos, sin, kv_cache, attn)
        norm = self.post_attention_layernorm
        residual, normed = fused.add_rms_norm(attn_out, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """forward(token_ids [T], positions [T], kv_caches, attn) -> hidden [T, hidden]; logits(hidden) -> [N, V]."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # Weights always come from a loader: no random init, whose normal_ on the meta device imports
        # torch._dynamo (2-3 s of every model load).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)
        # set by the packed-weight loader (kvpilot.model.quant): the output projection as a module
        self.output_head: nn.Module | None = None
        # set by the loader where it qualifies (kvpilot.model.fused_decode): the layers of a small decode step
        # in one C++ call, bit for bit the loop below
        self.fused_decode: FusedDecode | None = None
        # set by the packed-weight loader with the int8 path (quant.linear.Int8Gate): open for decode steps only
        self.int8_gate: Int8Gate | None = None
        # set for an EAGLE-3 head (launch/eagle.py): the layers whose inputs each forward leaves, concatenated
        # in this order, in aux_hidden [T, len * hidden] (the plain layer loop then runs: bit for bit the same)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn: StepAttention) -> torch.Tensor:
        if self.int8_gate is not None:  # a step with prompt tokens keeps them off the int8 path
            self.int8_gate.for_step(bool(getattr(attn.meta, "prefills", ())))
        x = self.embed(token_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        if self.aux_hidden_layers:
            return self._forward_keeping_aux(x, cos, sin, kv_caches, attn)
        if self.fused_decode is not None and self.fused_decode.applies(x, kv_caches, attn):
            return self.norm(self.fused_decode(x, cos, sin, kv_caches, attn))
        fused = self._residual_ops(x)
        if fused is not None:  # CUDA or bf16 rows on CPU: each residual add fused into the norm after it
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer.forward_deferred_add(x, residual, cos, sin, kv_cache, attn, fused)
            return fused.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[1] if residual is not None \
                else self.norm(x)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attn)
        return self.norm(x)

    def _residual_ops(self, x: torch.Tensor) -> Any | None:
        """What fuses a residual add into the next norm for rows `x` (Triton on CUDA, C++ for bf16 on CPU), where
        the layers have the plain residual pattern; None: the layers' own forward."""
        if x.dim() != 2 or x.stride(-1) != 1 or not self.layer_class.supports_deferred_add:
            return None
        return small_ops_for(x) or residual_ops_for(x, self.norm.weight)

    def _forward_keeping_aux(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             kv_caches: list[torch.Tensor], attn: StepAttention) -> torch.Tensor:
        """forward()'s layer loop, leaving the inputs of the aux_hidden_layers in aux_hidden."""
        inputs: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_hidden_layers:
                inputs[i] = x
            x = layer(x, cos, sin, kv_cache, attn)
        self.aux_hidden = torch.cat([inputs[i] for i in self.aux_hidden_layers], dim=-1)
        return self.norm(x)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `token_ids` (families that scale them override this)."""
        return self.embed_tokens(token_ids)

    def output_weight(self) -> torch.Tensor | None:
        """The dense [vocab, hidden] output projection (the embedding table itself when the two are tied);
        None when it is packed (an untied lm_head replaced by a packed module)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_head is not None:  # packed: float32 logits straight from the kernel's float32 sums
            return self.output_head.forward_float32(hidden)
        return F.linear(hidden, self.output_weight()).float()

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """logits(hidden).argmax(-1) (the first of equal maxima) where the output head computes it without the
        logits (packed, tiled: PackedLinear.greedy_ids); None otherwise."""
        greedy = getattr(self.output_head, "greedy_ids", None)
        return greedy(hidden) if greedy is not None else None

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Copies HF-named weights in (fusing q/k/v and gate/up); every parameter must be present, right-shaped."""
        copy_fused_weights(self, self.hf_state_dict(state), source, f"a {self.config.architecture} model")

    def hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named weights -> this module's names (families with other names or fusions override this)."""
        return fuse_hf_state_dict(state, self.config)


def copy_fused_weights(module: nn.Module, fused: dict[str, torch.Tensor], source: str, what: str) -> None:
    """Copies `fused` (this module's names, as fuse_hf_state_dict gives them) into every parameter of `module`,
    cast to its dtype; checks all before copying any. ModelLoadError naming `source` when a parameter has no
    weight (the first few names, `what` the module is: "a Qwen3ForCausalLM model", "an eagle3 head") or one of
    another shape (config and weights do not match). Extra weights are ignored."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(fused))
    if missing:
        raise ModelLoadError(f"{source}: missing weights {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                             f"({len(missing)} in all) for {what}")
    for name, param in params.items():
        tensor = fused[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(f"{source}: weight {name} has shape {tuple(tensor.shape)} but the config "
                                 f"implies {tuple(param.shape)}: config and weights of {what} do not match")
    for name, param in params.items():
        param.copy_(fused[name].to(param.dtype))


def _strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def fuse_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> this module's names; q/k/v and gate/up concatenated along the output dimension."""
    out = {_strip_model_prefix(k): v for k, v in state.items()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}"
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{prefix}.self_attn.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{prefix}.self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        gate, up = out.pop(f"{prefix}.mlp.gate_proj.weight", None), out.pop(f"{prefix}.mlp.up_proj.weight", None)
        if gate is not None and up is not None:
            out[f"{prefix}.mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    return out
