"""Weight bytes a model takes in memory in a given format: for a GGUF file (or a llama.cpp mix of a model without
one) tensor by tensor as kvpilot holds it (gguf_holding.py), for a pre-quantized HF checkpoint from its
quantization_config (checkpoint_formats.py), otherwise bits per role x parameter counts (weight_formats.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.checkpoint_formats import checkpoint_linear_bits
from kvpilot.fit.fingerprint import cpu_has_amx_bf16, cpu_int8_path
from kvpilot.fit.gguf_holding import PACKED_FAMILIES, held_gguf, int8_path_takes_all, packed_bits
from kvpilot.fit.gguf_mixes import BASE_TYPES, file_bits_per_weight, mix_tensors
from kvpilot.fit.gguf_sizes import GgufTensor
from kvpilot.fit.model_source import LoadedModel
from kvpilot.fit.units import gb_and_gib
from kvpilot.fit.weight_formats import WeightFormat, compute_dtype, device_dtype, dtype_bytes, weight_format

# kvpilot's --quantization int8 / int4 on a CPU: Q8_0 / Q4_1 blocks, the output layer Q8_0 (model/quant/at_load.py)
AT_LOAD_CPU = {"int8": "q8_0", "int4": "q4_1"}


@dataclass(frozen=True)
class WeightBytes:
    """Bytes held in memory by role. Invariant: num_bytes == embedding + lm_head + layers (all >= 0).
    num_bytes_file: the tensors' bytes in the GGUF file (or the llama.cpp mix) when sized tensor by tensor."""

    format_name: str
    num_bytes_embedding: int
    num_bytes_lm_head: int
    num_bytes_layers: int  # decoder layers (matrices, experts, norms, biases) + final norm
    num_bytes_expert: int  # one routed expert of one layer (0 for dense models)
    num_bytes_file: int | None = None
    notes: tuple[str, ...] = ()  # how the format is held, for the report

    @property
    def num_bytes(self) -> int:
        return self.num_bytes_embedding + self.num_bytes_lm_head + self.num_bytes_layers


def weight_bytes(model: LoadedModel, weight_dtype: str = "auto", dtype: str = "auto",
                 on_gpu: bool = False, cpu_int8: str | None = None,
                 cpu_fast_bf16: bool | None = None) -> WeightBytes:
    """What the weights take in kvpilot's memory on a GPU (`on_gpu`) or a CPU. `auto` is the model's own format:
    a GGUF file's tensors, a checkpoint's quantization_config, else its dtype; a llama.cpp mix name (q4_k_m,
    q8_0, ...) sizes the model as a file of that mix; int8 / int4 on a CPU as kvpilot quantizes at load (Q8_0 /
    Q4_1 blocks); other names are bits per role (weight_formats.py). `cpu_int8`: the CPU's int8 path for packed
    weights in bf16 (vnni, avx2, none: fingerprint.cpu_int8_path), `cpu_fast_bf16` whether it computes bf16
    natively (None: this machine's CPU; without, "auto" is float32 there, as in kvpilot)."""
    key = weight_dtype.strip().lower()
    int8 = cpu_int8_path() if cpu_int8 is None else cpu_int8
    dtype = device_dtype(dtype, on_gpu, cpu_fast_bf16, int8_packed(model, weight_dtype, int8))
    compute_bits = 8 * dtype_bytes(compute_dtype(model.spec, dtype))
    if model.gguf is not None and key == "auto":
        mix = ", ".join(f"{n} {t}" for t, n in sorted(model.gguf.tensor_types.items()))
        return _from_tensors(model, model.gguf.tensors, f"gguf ({mix})", compute_bits, on_gpu, cpu_int8=int8)
    if key in BASE_TYPES:
        tensors = mix_tensors(model.spec, key)
        label = f"{key} (llama.cpp mix: {file_bits_per_weight(tensors):.2f} bits a weight in the file)"
        return _from_tensors(model, tensors, label, compute_bits, on_gpu, cpu_int8=int8)
    # (the loader quantizes no mixture-of-experts model at load: those fall through to bits per role)
    if key in AT_LOAD_CPU and not on_gpu and model.spec.model_type in PACKED_FAMILIES and model.spec.moe is None:
        tensors = mix_tensors(model.spec, AT_LOAD_CPU[key], head="Q8_0")
        label = f"{key} (kvpilot's quantization at load: {AT_LOAD_CPU[key].upper()} blocks, the output layer Q8_0)"
        return _from_tensors(model, tensors, label, compute_bits, on_gpu, from_file=False, cpu_int8=int8)
    quant = model.hf_config.get("quantization_config")
    if key == "auto" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and not on_gpu \
            and model.spec.moe is not None:
        return _mxfp4_experts_packed(model, compute_bits)
    if key == "auto" and isinstance(quant, dict) and quant.get("quant_method"):
        name, bits, note = checkpoint_linear_bits(quant, on_gpu, compute_bits)
        return _by_role(model, WeightFormat(name, bits, compute_bits, compute_bits), (note,))
    fmt = weight_format(weight_dtype, model.spec, dtype)
    amx = not on_gpu and cpu_fast_bf16 is None and fmt.name == "bf16" and cpu_has_amx_bf16()
    return _by_role(model, fmt, (AMX_COPIES_NOTE,) if amx else ())


# model/layers/onednn_linear.py's amx_onednn_copies: not counted in the bytes, as the prompt GEMMs' dense copies
AMX_COPIES_NOTE = ("On this CPU (AMX) kvpilot also keeps copies of the bf16 projections and output layer packed for "
                   "AMX tiles (2 bytes a weight; where its tile kernels cannot be built, oneDNN-prepacked ones and a "
                   "float32 output layer, 4 bytes a weight) for decode steps, where they fit a quarter of the free "
                   "memory; not counted above.")


def int8_packed(model: LoadedModel, weight_dtype: str = "auto", cpu_int8: str | None = None) -> bool:
    """Whether kvpilot runs `model` (its own format: a GGUF file) with every linear weight packed on the int8 path
    of a CPU whose int8 path is `cpu_int8` (None: this machine's), where its --dtype auto is bf16."""
    if model.gguf is None or weight_dtype.strip().lower() != "auto":
        return False
    spec = model.spec
    return int8_path_takes_all(model.gguf.tensors, spec.model_type, spec.tie_word_embeddings,
                               cpu_int8_path() if cpu_int8 is None else cpu_int8)


def _mxfp4_experts_packed(model: LoadedModel, compute_bits: int) -> WeightBytes:
    """gpt-oss's MXFP4 checkpoint on a CPU: the routed experts kept as MXFP4 blocks (model/models/gpt_oss_weights.py),
    every other weight in the compute dtype."""
    p = model.params
    bits = packed_bits("MXFP4", int8_copy=False)
    dense = (p.num_linear_total - p.num_expert_matrix + p.num_vector) * compute_bits / 8
    return WeightBytes(f"mxfp4 experts packed, the rest {compute_bits}-bit",
                       round(p.num_embedding * compute_bits / 8), round(p.num_lm_head * compute_bits / 8),
                       round(dense + p.num_expert_matrix * bits / 8), round(p.num_params_per_expert * bits / 8),
                       notes=(f"kvpilot keeps the mxfp4 experts packed on CPU ({bits:g} bits a weight) and holds "
                              f"the other weights in {compute_bits}-bit",))


def _by_role(model: LoadedModel, fmt: WeightFormat, notes: tuple[str, ...] = ()) -> WeightBytes:
    p = model.params
    return WeightBytes(
        format_name=fmt.name,
        num_bytes_embedding=round(p.num_embedding * fmt.bits_embedding / 8),
        num_bytes_lm_head=round(p.num_lm_head * fmt.bits_embedding / 8),
        num_bytes_layers=round(p.num_linear_total * fmt.bits_linear / 8 + p.num_vector * fmt.bits_vector / 8),
        num_bytes_expert=round(p.num_params_per_expert * fmt.bits_linear / 8),
        notes=notes,
    )


def _from_tensors(model: LoadedModel, tensors: tuple[GgufTensor, ...], label: str, compute_bits: int,
                  on_gpu: bool, from_file: bool = True, cpu_int8: str = "vnni") -> WeightBytes:
    """`from_file`: the tensors are a GGUF's (or a llama.cpp mix's); False: blocks kvpilot quantizes at load."""
    spec = model.spec
    held = held_gguf(tensors, spec.model_type, spec.tie_word_embeddings, compute_bits, on_gpu, cpu_int8)
    file_bytes = sum(t.num_bytes for t in tensors) if from_file else None
    total = held.num_bytes_embedding + held.num_bytes_lm_head + held.num_bytes_layers
    size = f" ({gb_and_gib(total)} held for {gb_and_gib(file_bytes)} of tensors in the file)" if file_bytes else ""
    notes = [f"{held.reason}{size}."]
    if held.packed and compute_bits == 16 and from_file:
        notes.append("kvpilot serve's default --quantization auto may keep dense copies for prompt GEMMs beside the "
                     "packed weights (at most a quarter of the free memory); --quantization gguf holds none.")
    per_weight = held.bytes_per_expert_weight() if held.packed or held.packed_experts else compute_bits / 8
    expert = round(model.params.num_params_per_expert * per_weight)
    state = "packed" if held.packed else f"dequantized to {compute_bits}-bit"
    if held.packed_experts:
        state = f"experts packed, the rest {state}"
    return WeightBytes(f"{label}, held {state}", held.num_bytes_embedding, held.num_bytes_lm_head,
                       held.num_bytes_layers, expert, file_bytes, tuple(notes))
