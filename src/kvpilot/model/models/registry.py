"""The architecture registry: which model families kvpilot runs, and what runs each one.

Torch-free (the config parser reads it; the `kvpilot` command hands `kvpilot fit` a check built on it). One
`ModelFamily` entry in FAMILIES per family, whose modules live in a file of their own under
kvpilot/model/models/; a family is chosen by the HF config's `architectures[0]` or, for a GGUF file, by
`general.architecture` (mapped to the HF name by kvpilot.fit.gguf_metadata). The model class is named by
import path so that reading the registry never imports torch.

Invariants: every HF architecture and every GGUF architecture belongs to at most one family; a family's
`attention_backends` lists only backends that implement every attention feature its models can need.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass

ALL_BACKENDS = ("torch", "cpu", "triton")
ALL_FORMATS = ("safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelFamily:
    """One family of decoder models that share a module layout.

    `model_class`: "module:Class" of its nn.Module; `formats`: the weight formats it loads; `tensor_parallel`:
    whether it shards across ranks; `packed_gguf`: whether a GGUF's quantized weights stay packed (the CPU
    kernels) rather than being dequantized; `packed_gguf_experts`: where packed_gguf is not, whether the routed
    experts alone do (the rest dequantized); `fused_decode`: whether the C++ whole-model decode step applies.
    """

    name: str
    architectures: tuple[str, ...]
    model_class: str
    gguf_architectures: tuple[str, ...] = ()
    attention_backends: tuple[str, ...] = ALL_BACKENDS
    formats: tuple[str, ...] = ALL_FORMATS
    tensor_parallel: bool = True
    packed_gguf: bool = True
    packed_gguf_experts: bool = False
    fused_decode: bool = True
    notes: str = ""

    def load_class(self) -> type:
        """The family's model class (imports torch)."""
        module, _, name = self.model_class.partition(":")
        return getattr(importlib.import_module(module), name)


LLAMA_CLASS = "kvpilot.model.models.llama:LlamaForCausalLM"

# The families kvpilot runs. A new family adds its entry here and its module file beside this one.
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), LLAMA_CLASS, gguf_architectures=("llama",)),
    ModelFamily("mistral", ("MistralForCausalLM",), LLAMA_CLASS, gguf_architectures=("mistral",)),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), LLAMA_CLASS, gguf_architectures=("qwen2",),
                notes="q/k/v bias"),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), LLAMA_CLASS, gguf_architectures=("qwen3",),
                notes="q/k RMSNorm"),
    ModelFamily("gemma2", ("Gemma2ForCausalLM",), "kvpilot.model.models.gemma2:Gemma2ForCausalLM",
                gguf_architectures=("gemma2",), packed_gguf=False, fused_decode=False,
                notes="sliding/global layers, logit soft-capping, GeGLU, 4 norms a layer"),
    ModelFamily("gemma3_text", ("Gemma3ForCausalLM",), "kvpilot.model.models.gemma3:Gemma3ForCausalLM",
                gguf_architectures=("gemma3",), packed_gguf=False, fused_decode=False,
                notes="5 sliding : 1 global layers, RoPE base per layer type, q/k norm, GeGLU"),
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "kvpilot.model.models.qwen3_moe:Qwen3MoeForCausalLM",
                gguf_architectures=("qwen3moe",), fused_decode=False,
                notes="mixture of experts (softmax top-k, norm_topk_prob), q/k RMSNorm"),
    ModelFamily("mixtral", ("MixtralForCausalLM",), "kvpilot.model.models.mixtral:MixtralForCausalLM",
                fused_decode=False,
                notes="mixture of experts (top-k renormalised); GGUF: 'llama' with an expert count"),
    ModelFamily("gpt_oss", ("GptOssForCausalLM",), "kvpilot.model.models.gpt_oss:GptOssForCausalLM",
                gguf_architectures=("gpt-oss",), tensor_parallel=False, packed_gguf=False,
                packed_gguf_experts=True, fused_decode=False,
                notes="mixture of experts (top-k logits then softmax, router and expert biases, clamped SwiGLU; "
                      "bf16 CPU experts run the torch grouped path, not the C++ kernel), attention sinks, "
                      "sliding/full layers, YaRN; on CPU the experts of a GGUF or of OpenAI's MXFP4 checkpoint "
                      "stay packed (the other weights dense)"),
    ModelFamily("phi3", ("Phi3ForCausalLM",), "kvpilot.model.models.phi3:Phi3ForCausalLM",
                gguf_architectures=("phi3",), tensor_parallel=False, packed_gguf=False, fused_decode=False,
                notes="fused qkv/gate_up, LongRoPE, partial rotary (Phi-4-mini)"),
)


def _check_unique(entries: tuple[ModelFamily, ...]) -> None:
    seen: dict[str, str] = {}
    for family in entries:
        for arch in family.architectures + family.gguf_architectures:
            if arch in seen:
                raise ValueError(f"architecture {arch!r} claimed by both {seen[arch]} and {family.name}")
            seen[arch] = family.name


_check_unique(FAMILIES)


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(arch for family in FAMILIES for arch in family.architectures))


def family_for_architecture(arch: str | None) -> ModelFamily | None:
    """The family that runs HF architecture `arch`; None when none does."""
    return next((family for family in FAMILIES if arch in family.architectures), None)


def unsupported_message(arch: str | None, source: str) -> str:
    """Names the supported architectures and the closest one to `arch`."""
    supported = supported_architectures()
    close = difflib.get_close_matches(str(arch), supported, n=1, cutoff=0.5)
    hint = f" (closest: {close[0]})" if close else ""
    return (f"{source}: unsupported architecture {arch!r}{hint}; kvpilot runs "
            f"{', '.join(supported)}")
