"""load_model: resolves a --model value (GGUF file, HF directory, dummy config, or the embedded default)
into a ModelConfig, a ready model of its family (kvpilot.model.models) and a Tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from kvpilot.model.choices import check_prompt_gemm_dtype
from kvpilot.model.config import ModelConfig, from_hf_config
from kvpilot.model.cpu_kernels import build_cpu_kernels, kernels_for
from kvpilot.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from kvpilot.model.dtypes import resolve_dtype
from kvpilot.model.errors import ModelLoadError, config_errors_as_load_errors
from kvpilot.model.fused_decode import FusedDecode
from kvpilot.model.hub import missing_model_message
from kvpilot.model.layers.moe import prepack_experts
from kvpilot.model.layers.onednn_linear import amx_onednn_copies, prepack_bf16_linears
from kvpilot.model.layers.prompt_gemm import dense_float32_min_rows, resolve_prompt_gemm_dtype
from kvpilot.model.models.llama import LlamaForCausalLM
from kvpilot.model.models.registry import ModelFamily, family_for_architecture
from kvpilot.model.parallel.shard_plan import ShardPlan
from kvpilot.model.quant.memory_report import PackedMemory, report_packed_memory
from kvpilot.model.quant.model_pack import check_quantization
from kvpilot.model.tokenizer import Tokenizer
from kvpilot.model.weight_layout import relayout_linear_weights

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
PREQUANTIZED_ONLY = ("awq", "gptq", "compressed-tensors")  # --quantization values only a checkpoint can honour
# the GGUF readers of the load_model call in progress, by resolved path (_read_header)
_HEADERS: ContextVar[dict[Path, Any] | None] = ContextVar("kvpilot_gguf_headers", default=None)


@dataclass
class LoadedModel:
    """What every loader produces. Invariant: model's parameters are on `device` in `dtype`."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    name: str
    source: str
    load_format: str
    dtype: torch.dtype
    device: torch.device
    # how the linear weights are held: "none" (dense, in dtype), "gguf" (the GGUF's packed blocks) or
    # "int8" / "int4" (quantized at load; packed ones run in the CPU kernels of kvpilot.model.quant), "fp8"
    quantization: str = "none"
    # the dtype of many-row GEMMs (packed layers: steps with prompt tokens; dense bf16 ones: calls of 32+ rows)
    # under bf16 activations (layers/prompt_gemm.py); CPU only (None elsewhere)
    prompt_gemm_dtype: torch.dtype | None = None
    # tensor parallelism: the rank whose shard `model` holds (built from shard.local_config; `config` is the
    # whole model's); None: the whole model
    shard: ShardPlan | None = None
    # quantization "gguf": the file's bits per weight over all its tensors (5.74 for the embedded Q4_1 model, its
    # embedding Q8_0); None otherwise (the other quantizations' widths are their names: see weight_bits)
    gguf_bits_per_weight: float | None = None
    # quantization "gguf": what the packed layers hold against their tensors' bytes in the file (logged at load)
    packed_memory: PackedMemory | None = None
    # a pre-quantized HF checkpoint's quant_method (awq, gptq, fp8, compressed-tensors; quant/checkpoint_scheme.py),
    # whether its layers stay quantized (`quantization` is then the same name) or were dequantized ("none")
    checkpoint_quantization: str | None = None
    checkpoint_bits: float | None = None
    # a checkpoint's fp8 KV cache scales, (k_scale, v_scale) by layer index (quant/checkpoint_tensors.py); an fp8
    # cache uses them instead of calibrating (model/kv_scales.py)
    kv_cache_scales: dict[int, tuple[float, float]] | None = None

    @property
    def weight_bits(self) -> float:
        """Bits a weight takes as the decode reads it: what quantizing further could save."""
        if self.quantization == "gguf" and self.gguf_bits_per_weight is not None:
            return self.gguf_bits_per_weight
        if self.checkpoint_bits is not None and self.quantization != "none":
            return self.checkpoint_bits
        nominal = {"int4": 4.0, "int8": 8.0, "fp8": 8.0}.get(self.quantization)
        return nominal if nominal is not None else float(self.dtype.itemsize * 8)


def _materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`Module.to_empty` without its `empty_like`, which on meta tensors imports sympy (0.6 s a load)."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


def _build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 prepare: Callable[[LlamaForCausalLM], object] | None = None) -> LlamaForCausalLM:
    """The family's model class, built on the meta device; `prepare` runs on the model while it is still there
    (before any memory is allocated)."""
    model_class = family_of(config).load_class()
    with torch.device("meta"):
        model = model_class(config, max_positions)
    if prepare is not None:
        prepare(model)
    model = _materialize(model, device).to(dtype)
    model.rotary.reset_tables(device)  # built on meta (no memory): compute the float32 tables for real
    return model.eval()


def family_of(config: ModelConfig) -> ModelFamily:
    family = family_for_architecture(config.architecture)
    if family is None:  # from_hf_config checked it: a ModelConfig built by hand
        raise ModelLoadError(f"no model family runs {config.architecture!r}")
    return family


@dataclass(frozen=True)
class TPRank:
    """Which shard to load: rank `rank` of `size` (size 1: the whole model)."""

    rank: int = 0
    size: int = 1

    def plan(self, config: ModelConfig) -> ShardPlan | None:
        if self.size == 1:
            return None
        if not family_of(config).tensor_parallel:
            raise ModelLoadError(f"{config.architecture} models do not run with tensor parallelism yet: use "
                                 "--tensor-parallel-size 1")
        return ShardPlan.for_rank(config, self.rank, self.size)


def _model_config(config: ModelConfig, plan: ShardPlan | None) -> ModelConfig:
    return config if plan is None else plan.local_config


def _read_header(path: Path) -> Any:
    """open_gguf(path), once per load_model call (a header with a 49k-token vocabulary takes ~0.2 s to parse);
    outside one, a fresh reader. The readers go when the call returns, as the file's mapping with them."""
    from kvpilot.fit.gguf_metadata import open_gguf

    headers = _HEADERS.get()
    if headers is None:
        return open_gguf(path)
    key = path.resolve()
    if key not in headers:
        headers[key] = open_gguf(path)
    return headers[key]


def _load_gguf(path: Path, max_model_len: int | None, dtype: torch.dtype, device: torch.device,
               quantization: str, tp: TPRank, gemm_dtype: torch.dtype | None = None,
               int8_prompts: bool = False) -> LoadedModel:
    from kvpilot.fit.gguf_metadata import hf_config_from_reader
    from kvpilot.fit.gguf_sizes import gguf_sizes
    from kvpilot.model.gguf_weights import is_expert_weight, linear_tensor_types, load_gguf_tensors
    from kvpilot.model.quant.memory_report import warn_dequantized
    from kvpilot.model.quant.model_pack import (keeps_dense, pack_experts, pack_linear_layers, packed_names,
                                                release_packed_quants)
    from kvpilot.model.tokenizer import tokenizer_from_gguf

    reader = _read_header(path)
    config = from_hf_config(hf_config_from_reader(reader, path), str(path))
    plan = tp.plan(config)
    # a rank's shards are dense (the engine refuses packed quantization with TP), and so are the weights of
    # a family the packed kernels do not run, but for the routed experts of one whose experts they do
    family = family_of(config)
    packs = plan is None and family.packed_gguf
    experts_only = plan is None and not packs and family.packed_gguf_experts
    if plan is None and not packs and not experts_only and quantization == "gguf":
        raise ModelLoadError(f"{path}: the packed GGUF kernels do not run {config.architecture} models yet; use "
                             "--quantization auto or none (the weights are dequantized at load)")
    types = linear_tensor_types(reader)
    if experts_only:
        types = {name: type_name for name, type_name in types.items() if is_expert_weight(name)}
    names = packed_names(quantization, device, types, config, path) if packs or experts_only else frozenset()
    dense, packed = load_gguf_tensors(reader, path, config, names, take=plan.take if plan else None)
    prepare: Callable[[LlamaForCausalLM], object] | None = None
    if names and experts_only:
        prepare = partial(pack_experts, packed=packed)
    elif names:  # the hybrid layout's dense copies are for packed dense layers' prompts (int8 prompts: none)
        hybrid = not int8_prompts and keeps_dense(quantization, dtype, packed, psutil.virtual_memory().available,
                                                  gemm_dtype)
        prepare = partial(pack_linear_layers, packed=packed, config=config, keep_dense=hybrid, compute_dtype=dtype,
                          gemm_dtype=gemm_dtype)
    model = _build_model(_model_config(config, plan), max_model_len or config.max_position_embeddings, dtype,
                         device, prepare)
    model.load_weights(dense, str(path))
    if names:
        release_packed_quants(model, dtype)
    if plan is None and (not names or experts_only):  # a rank's shard holds only its part: it would mislead
        warn_dequantized(model, reader, path, skipped=names)
    # A GGUF without vocabulary metadata still runs on token ids.
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    tokenizer = tokenizer_from_gguf(reader, path) if has_vocab else None
    bits = gguf_sizes(reader).bits_per_weight if names else None
    memory = report_packed_memory(model, reader, names) if names else None
    return LoadedModel(config, model, tokenizer, config.name or path.stem, str(path), "gguf", dtype, device,
                       "gguf" if names else "none", shard=plan, gguf_bits_per_weight=bits, packed_memory=memory)


def _load_hf_dir(path: Path, max_model_len: int | None, dtype: torch.dtype, device: torch.device,
                 tp: TPRank, quantization: str = "auto", gemm_dtype: torch.dtype | None = None) -> LoadedModel:
    from kvpilot.model.hf_dir import load_safetensors_state_dict, read_hf_config
    from kvpilot.model.quant.checkpoint_scheme import read_checkpoint_scheme, resolve_checkpoint_quantization
    from kvpilot.model.quant.checkpoint_tensors import take_kv_cache_scales
    from kvpilot.model.tokenizer import tokenizer_from_hf_dir

    hf_config = read_hf_config(path)
    scheme = resolve_checkpoint_quantization(quantization, read_checkpoint_scheme(hf_config, str(path)), str(path))
    config = from_hf_config(hf_config, str(path / "config.json"))
    plan = tp.plan(config)
    if scheme is not None and plan is not None:
        raise ModelLoadError(f"{path}: pre-quantized ({scheme.method}) checkpoints do not run with tensor parallelism "
                             "yet; use --tensor-parallel-size 1")
    state = load_safetensors_state_dict(path, index=plan.index if plan else None)
    kv_cache_scales = take_kv_cache_scales(state)
    prequantized = None
    prepare: Callable[[LlamaForCausalLM], object] | None = None
    if scheme is not None:
        from kvpilot.model.quant.checkpoint_load import PrequantizedLoad
        prequantized = PrequantizedLoad(state, scheme, config, str(path), device, dtype,
                                        dense_only=quantization == "none", gemm_dtype=gemm_dtype)
        prepare = prequantized.prepare
    elif plan is None and quantization == "auto" and device.type == "cpu" and family_of(config).packed_gguf_experts:
        prepare = _packed_mxfp4_experts(state, config)
    model = _build_model(_model_config(config, plan), max_model_len or config.max_position_embeddings, dtype,
                         device, prepare)
    model.load_weights(state, str(path))
    if prequantized is not None:
        prequantized.install(model)
    tokenizer = tokenizer_from_hf_dir(path, config.eos_token_ids) if (path / "tokenizer.json").is_file() else None
    loaded = LoadedModel(config, model, tokenizer, path.name, str(path), "safetensors", dtype, device, shard=plan,
                         kv_cache_scales=kv_cache_scales or None)
    if prequantized is not None:
        loaded.quantization = prequantized.quantization
        loaded.checkpoint_quantization, loaded.checkpoint_bits = scheme.method, scheme.bits
    return loaded


def _packed_mxfp4_experts(state: dict[str, torch.Tensor],
                          config: ModelConfig) -> Callable[[LlamaForCausalLM], object] | None:
    """gpt-oss's MXFP4 experts kept packed on CPU (their tensors taken from `state`): the prepare step that installs
    them, or None (no MXFP4 experts, or no CPU kernel: they are dequantized at load)."""
    from kvpilot.model.models.gpt_oss_weights import take_mxfp4_expert_blocks
    from kvpilot.model.quant.kernel import get_quant_kernel
    from kvpilot.model.quant.model_pack import pack_experts

    if get_quant_kernel() is None:
        return None
    packed = take_mxfp4_expert_blocks(state, config.num_hidden_layers)
    if not packed:
        return None
    logger.info("MXFP4 experts kept packed: %.1f MiB of blocks", sum(b.nbytes for b in packed.values()) / 2**20)
    return lambda model: pack_experts(model, packed)


def _load_dummy(name: str, max_model_len: int | None, dtype: torch.dtype, device: torch.device,
                seed: int, tp: TPRank) -> LoadedModel:
    from kvpilot.model.dummy import dummy_hf_config, init_dummy_weights

    config = from_hf_config(dummy_hf_config(name), f"dummy:{name}")
    plan = tp.plan(config)
    model = _build_model(_model_config(config, plan), max_model_len or config.max_position_embeddings, dtype,
                         device)
    init_dummy_weights(model, seed, plan)
    return LoadedModel(config, model, _fallback_tokenizer(config), name, f"dummy:{name}", "dummy", dtype, device,
                       shard=plan)


def _fallback_tokenizer(config: ModelConfig) -> Tokenizer | None:
    """Dummy models have no tokenizer of their own: borrow the embedded model's when its ids fit the vocab."""
    try:
        path = default_model_path()
    except ModelLoadError:
        return None
    from kvpilot.fit.gguf_metadata import open_gguf
    from kvpilot.model.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(open_gguf(path), path)
    return tokenizer if tokenizer.vocab_size <= config.vocab_size else None


def load_model(model: str | None = None, *, load_format: str = "auto", dtype: str = "auto",
               device: str | None = None, max_model_len: int | None = None, seed: int = 0,
               quantization: str = "auto", tp_rank: int = 0, tp_size: int = 1,
               prompt_gemm_dtype: str = "auto") -> LoadedModel:
    """Loads `model`: None = the embedded SmolLM2-135M-Instruct GGUF; a .gguf file; an HF directory;
    or, with load_format="dummy" (or a "dummy:" prefix), a catalog name / config.json with random weights.
    `quantization` (auto, gguf, none) says whether a GGUF's quantized linear weights stay packed on CPU
    (kvpilot.model.quant.model_pack); int8 / int4 quantize any model's linear weights at load (CPU); an HF
    directory whose config.json has a quantization_config (AWQ, GPTQ, fp8, compressed-tensors) is read as
    quantized under auto or its method's name, dequantized under none, and refused under anything else
    (kvpilot.model.quant.checkpoint_load);
    `dtype` is the activations' (and dense weights') dtype; `prompt_gemm_dtype` (auto, bfloat16, float32) the
    dtype of many-row GEMMs under bf16 activations on CPU (auto: measured, layers/prompt_gemm.py); int8 sends
    prompt rows through the int8 path's tiled copies too (packed GGUF layers in bf16 on a CPU with AVX-512 VNNI or
    AVX2; no dense copies are kept) and the other layers' GEMMs in auto's dtype. With
    tp_size > 1 the model holds only rank `tp_rank`'s shard (kvpilot.model.parallel.shard_plan), read as such:
    the whole weights are never held.

    Raises ModelLoadError with the file and the problem for anything it cannot load.
    """
    headers = _HEADERS.set({})  # the dtype decision and the load read a GGUF's header once between them
    try:
        return _load_model(model, load_format, dtype, device, max_model_len, seed, quantization, tp_rank, tp_size,
                           prompt_gemm_dtype)
    finally:
        _HEADERS.reset(headers)


def _load_model(model: str | None, load_format: str, dtype: str, device: str | None, max_model_len: int | None,
                seed: int, quantization: str, tp_rank: int, tp_size: int, prompt_gemm_dtype: str) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    torch_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    int8_packed = dtype == "auto" and int8_path_takes_gguf(model, load_format, torch_device, quantization, tp_size)
    torch_dtype = resolve_dtype(dtype, torch_device, int8_packed)
    check_quantization(quantization)
    try:
        check_prompt_gemm_dtype(prompt_gemm_dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if torch_device.type == "cpu":
        build_cpu_kernels(kernels_for(torch_dtype))  # side by side now, not one by one as loading reaches them
    # resolved once (a CPU measures it, once a process): packed, quantized-at-load and dense layers all follow it
    int8_prompts = prompt_gemm_dtype == "int8"
    gemm_dtype = resolve_prompt_gemm_dtype("auto" if int8_prompts else prompt_gemm_dtype, torch_dtype,
                                           torch_device) if torch_device.type == "cpu" else None
    with config_errors_as_load_errors():  # a bad GGUF header, read by kvpilot.fit.gguf_metadata
        loaded = _load(model, load_format, max_model_len, torch_dtype, torch_device, seed, quantization,
                       TPRank(tp_rank, tp_size), gemm_dtype, int8_prompts)
    if int8_prompts:
        _take_prompts_int8(loaded)
    loaded.prompt_gemm_dtype = gemm_dtype
    if loaded.checkpoint_quantization is not None:  # its own quantization, resolved against the flag at load
        quantization = "none"
    if quantization in ("int8", "int4", "fp8") and loaded.config.num_experts:
        raise ModelLoadError(f"--quantization {quantization} does not quantize mixture-of-experts models "
                             f"({loaded.config.architecture}) yet: use --quantization none")
    if quantization in ("int8", "int4"):
        _quantize_at_load(loaded, quantization)
    elif quantization == "fp8":
        from kvpilot.model.quant.fp8 import check_fp8_device, quantize_fp8_layers

        check_fp8_device(loaded.device)
        quantize_fp8_layers(loaded.model)
        loaded.quantization = "fp8"
    if torch_device.type == "cpu":
        available = psutil.virtual_memory().available
        float32_rows = dense_float32_min_rows(loaded.model, loaded.prompt_gemm_dtype, available)
        onednn_copies = float32_rows is None and amx_onednn_copies(loaded.model, available)
        prepack_bf16_linears(loaded.model, float32_rows, onednn_copies)  # bf16: oneDNN's layout, once
        prepack_experts(loaded.model)  # mixture-of-experts weights: the same, one expert at a time
        relayout_linear_weights(loaded.model)
        # no fused decode for a TP rank: the C++ layer loop knows nothing of a rank's all-reduces
        if loaded.shard is None and family_of(loaded.config).fused_decode:
            loaded.model.fused_decode = FusedDecode.for_model(loaded.model)
    return loaded


def int8_path_takes_gguf(model: str | None, load_format: str, device: torch.device, quantization: str,
                          tp_size: int) -> bool:
    """Whether `model` is a GGUF file whose linear weights would all run packed on this CPU's int8 path in bf16
    (fit's rule, gguf_holding.int8_path_takes_all, on the file's header); False for anything it cannot read."""
    from kvpilot.fit.errors import ConfigError
    from kvpilot.fit.gguf_holding import int8_path_takes_all
    from kvpilot.fit.gguf_metadata import hf_config_from_reader
    from kvpilot.fit.gguf_sizes import gguf_sizes
    from kvpilot.model.quant.kernel import int8_path

    if device.type != "cpu" or quantization not in ("auto", "gguf") or tp_size > 1 \
            or load_format not in ("auto", "gguf"):
        return False
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file() or int8_path() == "none":
        return False
    try:
        reader = _read_header(path)
        cfg = hf_config_from_reader(reader, path)
    except ConfigError:  # _load reports a bad file with its own message
        return False
    return int8_path_takes_all(gguf_sizes(reader).tensors, str(cfg.get("model_type")),
                               bool(cfg.get("tie_word_embeddings")), int8_path())


def _take_prompts_int8(loaded: LoadedModel) -> None:
    """--prompt-gemm-dtype int8: the model's Int8Gate stays open in steps with prompt tokens; ModelLoadError where
    the model has no int8 path."""
    gate = getattr(loaded.model, "int8_gate", None)
    if gate is None:
        raise ModelLoadError("--prompt-gemm-dtype int8 computes prompts on the int8 path of packed GGUF weights: it "
                             "needs a GGUF file with --quantization auto or gguf, bf16 activations (--dtype bfloat16, "
                             "or auto where it resolves to bf16) and a CPU with AVX-512 VNNI or AVX2; use auto")
    gate.prompts = True


def _quantize_at_load(loaded: LoadedModel, quantization: str) -> None:
    from kvpilot.model.quant.at_load import quantize_linear_layers

    if loaded.device.type != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on CPU only (device {loaded.device.type})")
    quantize_linear_layers(loaded.model, quantization, loaded.dtype, loaded.prompt_gemm_dtype)
    loaded.quantization = quantization


def _load(model: str | None, load_format: str, max_model_len: int | None, dtype: torch.dtype,
          device: torch.device, seed: int, quantization: str, tp: TPRank,
          gemm_dtype: torch.dtype | None, int8_prompts: bool = False) -> LoadedModel:
    if model and model.startswith("dummy:"):
        model, load_format = model[len("dummy:"):], "dummy"
    if quantization == "gguf" and (load_format == "dummy" or (model is not None and Path(model).is_dir())):
        raise ModelLoadError("quantization 'gguf' keeps a GGUF file's quantized weights packed: "
                             f"{model or 'this model'} is not a GGUF file; use auto or none")
    if quantization in PREQUANTIZED_ONLY and (load_format == "dummy" or model is None or not Path(model).is_dir()):
        raise ModelLoadError(f"--quantization {quantization} reads pre-quantized HF checkpoints (a directory whose "
                             f"config.json has a quantization_config): {model or 'the embedded model'} is not one; "
                             "use auto, or int4 / fp8 to quantize at load")
    if load_format == "dummy":
        return _load_dummy(model or "smollm2-135m", max_model_len, dtype, device, seed, tp)
    if model is None:
        loaded = _load_gguf(default_model_path(), max_model_len, dtype, device, quantization, tp, gemm_dtype,
                            int8_prompts)
        loaded.name = DEFAULT_MODEL_NAME
        return loaded
    path = Path(model).expanduser()
    if path.is_dir():
        return _load_hf_dir(path, max_model_len, dtype, device, tp, quantization, gemm_dtype)
    if path.is_file() or path.suffix == ".gguf":
        return _load_gguf(path, max_model_len, dtype, device, quantization, tp, gemm_dtype, int8_prompts)
    raise ModelLoadError(missing_model_message(model))
