"""Mixture-of-experts decode against its dense equivalent, side by side in one run: Qwen3-30B-A3B's layer shapes
(128 experts of width 768, top-8, hidden 2048, 32 query / 4 KV heads of 128) at a few layers, with dummy weights,
next to the same model with one dense MLP of the routed experts' total width (8 x 768 = 6,144): equal *active*
parameters (the dense one lacks only the router, 0.26M a layer). Decode steps of the two alternate in rounds (a
shared machine's slow phases hit both alike); prints each one's median tok/s with its spread and the ratio.

    .venv/bin/python benchmarks/moe_decode.py                         # CPU, batch 1, 4 layers, bf16
    .venv/bin/python benchmarks/moe_decode.py --device cuda --batch 64
    .venv/bin/python benchmarks/moe_decode.py --smoke                 # a few steps: checks that it runs
    .venv/bin/python benchmarks/moe_decode.py --packed-gguf           # packed GGUF experts vs dequantized, CPU
    .venv/bin/python benchmarks/moe_decode.py --packed-gguf --smoke
    .venv/bin/python benchmarks/moe_decode.py --packed-gguf --gpt-oss  # gpt-oss-20b's shapes, MXFP4 experts

The issue's goal: MoE decode at batch 1 >= 0.7x the dense equivalent (both read about the same weight bytes a
token: the top-k experts' against the dense MLP's). The vocabulary defaults to 32k, not Qwen's 152k, so that the
output layer (the same in both) does not hide the layers' difference; --vocab-size 151936 for the real one.

--packed-gguf: a GGUF of the same shapes (at --layers, default 1 here: the dequantized copy takes ~3x the file, and
the gguf package's dequantization at load dominates the run) with random valid blocks (experts and attention
--gguf-type, default Q4_K, the head Q6_K, the router float32; written once under --cache-dir), loaded twice in one
process: experts packed (--quantization gguf: int8 copies and the grouped C++ kernel with bf16 on a VNNI CPU) and
dequantized at load (--quantization none: the bf16 C++ experts kernel); decode at batch 1, then at batch 16 (15
requests joining the first), the two alternating in rounds; prints each one's tok/s, what it holds, and the ratio.
With --gpt-oss: a `gpt-oss` GGUF of gpt-oss-20b's layer shapes (32 experts of width 2880, top-4, hidden 2880, 64
query / 8 KV heads of 64), its experts MXFP4 and the rest Q8_0, as llama.cpp's converter leaves them: packed, only the
experts stay packed (PackedExperts with biases and the clamped SwiGLU, float32 kernel).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvpilot import LLM, SamplingParams
from kvpilot.fit.model_catalog import get_hf_config


def configs(layers: int, vocab: int) -> dict[str, dict]:
    """The MoE config and its dense equivalent (equal active parameters)."""
    moe = {**get_hf_config("qwen3-30b-a3b"), "num_hidden_layers": layers, "vocab_size": vocab,
           "bos_token_id": 1, "eos_token_id": 2}
    dense = {**get_hf_config("qwen3-8b"), **{k: moe[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
        "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id")},
        "intermediate_size": moe["num_experts_per_tok"] * moe["moe_intermediate_size"]}
    return {"moe": moe, "dense": dense}


def start(config: dict, directory: Path, args: argparse.Namespace) -> LLM:
    """An engine on dummy weights whose `batch` requests have finished their prefill (all decode from here)."""
    (directory / "config.json").write_text(json.dumps(config))
    max_tokens = args.rounds * args.steps + 8
    llm = LLM(model=str(directory), load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.context + max_tokens + 16, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory)
    rng = random.Random(0)
    for _ in range(args.batch):
        prompt = [rng.randrange(100, config["vocab_size"]) for _ in range(args.context)]
        llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    produced: set[str] = set()
    while len(produced) < args.batch:  # a request's first output ends its prefill
        produced.update(o.request_id for o in llm.engine.step())
    return llm


def step_seconds(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def report(name: str, times: list[float], batch: int) -> float:
    """Prints median tok/s and the spread (tok/s at the steps' 10th and 90th percentiles); returns the median."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    fast, slow = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    print(f"  {name:6s} {batch / median:8.1f} tok/s  (median step {median * 1e3:.2f} ms; p10-p90 "
          f"{batch / slow:.1f}-{batch / fast:.1f} tok/s; {len(times)} steps)")
    return batch / median


# byte offsets of the float16 fields of a block, set to small finite scales in random blocks
_HALF_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}


def _random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / block_values * block_bytes]: random quants with float16 scales of +-0.02 (valid blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    if type_name == "MXFP4":  # exponent bytes: scales 2^-10 .. 2^-6 (values up to 6 of them: +-0.1)
        raw[:, :, 0] = rng.integers(118, 123, size=(rows, cols // values), dtype=np.uint8)
    for offset in _HALF_FIELDS[type_name]:
        scales = rng.uniform(-0.02, 0.02, size=(rows, cols // values)).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def write_moe_gguf(config: dict, path: Path, type_name: str) -> None:
    """A `qwen3moe` GGUF of `config`'s shapes, random valid blocks (see --packed-gguf)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(0)
    h, e, inter = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), "qwen3moe")
    for add, value in ((writer.add_block_count, config["num_hidden_layers"]), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, h), (writer.add_feed_forward_length, config["intermediate_size"]),
                       (writer.add_head_count, config["num_attention_heads"]),
                       (writer.add_head_count_kv, config["num_key_value_heads"]),
                       (writer.add_key_length, config["head_dim"]), (writer.add_value_length, config["head_dim"]),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 1e6),
                       (writer.add_vocab_size, config["vocab_size"]), (writer.add_bos_token_id, 1),
                       (writer.add_eos_token_id, 2), (writer.add_expert_count, e),
                       (writer.add_expert_used_count, config["num_experts_per_tok"]),
                       (writer.add_expert_feed_forward_length, inter)):
        add(value)

    def matrix(name: str, shape: tuple[int, ...], kind: str) -> None:
        raw = _random_blocks(kind, int(np.prod(shape[:-1])), shape[-1], rng)
        writer.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=GGMLQuantizationType[kind])

    matrix("token_embd.weight", (config["vocab_size"], h), "Q8_0")
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    matrix("output.weight", (config["vocab_size"], h), "Q6_K")
    for i in range(config["num_hidden_layers"]):
        for norm, width in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", config["head_dim"]),
                            ("attn_k_norm", config["head_dim"])):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(width, dtype=np.float32))
        for name, shape in (("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q)),
                            ("ffn_gate_exps", (e, inter, h)), ("ffn_up_exps", (e, inter, h)),
                            ("ffn_down_exps", (e, h, inter))):
            matrix(f"blk.{i}.{name}.weight", shape, type_name)
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((e, h)) * 0.05).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)


def gpt_oss_config(layers: int, vocab: int) -> dict:
    return {**get_hf_config("gpt-oss-20b"), "num_hidden_layers": layers, "vocab_size": vocab,
            "layer_types": ["sliding_attention", "full_attention"] * layers}


def write_gpt_oss_gguf(config: dict, path: Path) -> None:
    """A `gpt-oss` GGUF of `config`'s shapes: random MXFP4 experts, Q8_0 attention, embeddings and head, float32
    router, biases, sinks and norms (llama.cpp's names and metadata, tests/model/gpt_oss_gguf.py)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType

    rng = np.random.default_rng(0)
    h, e, inter = config["hidden_size"], config["num_local_experts"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), "gpt-oss")
    rope = config["rope_scaling"]
    for add, value in ((writer.add_block_count, config["num_hidden_layers"]), (writer.add_context_length, 131072),
                       (writer.add_embedding_length, h), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, config["num_attention_heads"]),
                       (writer.add_head_count_kv, config["num_key_value_heads"]),
                       (writer.add_key_length, config["head_dim"]), (writer.add_value_length, config["head_dim"]),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, config["rope_theta"]),
                       (writer.add_rope_scaling_type, RopeScalingType.YARN),
                       (writer.add_rope_scaling_factor, rope["factor"]),
                       (writer.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"]),
                       (writer.add_vocab_size, config["vocab_size"]), (writer.add_bos_token_id, 1),
                       (writer.add_eos_token_id, 2), (writer.add_expert_count, e),
                       (writer.add_expert_used_count, config["num_experts_per_tok"]),
                       (writer.add_expert_feed_forward_length, inter),
                       (writer.add_sliding_window, config["sliding_window"])):
        add(value)

    def matrix(name: str, shape: tuple[int, ...], kind: str) -> None:
        raw = _random_blocks(kind, int(np.prod(shape[:-1])), shape[-1], rng)
        writer.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=GGMLQuantizationType[kind])

    def vector(name: str, shape: tuple[int, ...], scale: float) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    matrix("token_embd.weight", (config["vocab_size"], h), "Q8_0")
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    matrix("output.weight", (config["vocab_size"], h), "Q8_0")
    for i in range(config["num_hidden_layers"]):
        for norm in ("attn_norm", "post_attention_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
        for name, shape in (("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q))):
            matrix(f"blk.{i}.{name}.weight", shape, "Q8_0")
            vector(f"blk.{i}.{name}.bias", shape[:1], 0.02)
        vector(f"blk.{i}.attn_sinks.weight", (config["num_attention_heads"],), 1.0)
        vector(f"blk.{i}.ffn_gate_inp.weight", (e, h), 0.05)
        vector(f"blk.{i}.ffn_gate_inp.bias", (e,), 0.02)
        for name, shape in (("ffn_gate_exps", (e, inter, h)), ("ffn_up_exps", (e, inter, h)),
                            ("ffn_down_exps", (e, h, inter))):
            matrix(f"blk.{i}.{name}.weight", shape, "MXFP4")
            vector(f"blk.{i}.{name}.bias", shape[:2], 0.02)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)


def start_gguf(path: Path, quantization: str, args: argparse.Namespace) -> LLM:
    """An engine on the GGUF whose one request has finished its prefill (batch-1 decodes from here)."""
    max_tokens = 2 * (args.rounds * args.steps + 8)
    llm = LLM(model=str(path), quantization=quantization, dtype=args.dtype, device="cpu",
              max_model_len=args.context + max_tokens + 16, max_num_seqs=16, kv_cache_memory=args.kv_cache_memory)
    grow(llm, 1, args, max_tokens)
    return llm


def grow(llm: LLM, batch: int, args: argparse.Namespace, max_tokens: int | None = None) -> None:
    """Adds requests until `batch` decode; returns once each new one has finished its prefill."""
    rng = random.Random(getattr(llm, "_kvp_requests", 0))
    max_tokens = max_tokens or 2 * (args.rounds * args.steps + 8)
    ids = []
    for _ in range(batch - getattr(llm, "_kvp_requests", 0)):
        prompt = [rng.randrange(100, args.vocab_size) for _ in range(args.context)]
        ids.append(llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True)))
    llm._kvp_requests = batch  # type: ignore[attr-defined]
    produced: set[str] = set()
    while len(produced) < len(ids):
        produced.update(o.request_id for o in llm.engine.step())


def main_packed_gguf(args: argparse.Namespace) -> None:
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if args.gpt_oss:
        shapes, kinds = "gpt-oss-20b", "MXFP4 experts, Q8_0 attention"
        path = cache / f"gpt-oss-shapes-{args.layers}l-{args.vocab_size}v-MXFP4.gguf"
        if not path.is_file():
            print(f"writing {path} (random blocks)", flush=True)
            write_gpt_oss_gguf(gpt_oss_config(args.layers, args.vocab_size), path)
    else:
        shapes, kinds = "Qwen3-30B-A3B", args.gguf_type
        path = cache / f"qwen3moe-shapes-{args.layers}l-{args.vocab_size}v-{args.gguf_type}.gguf"
        if not path.is_file():
            print(f"writing {path} (random blocks)", flush=True)
            write_moe_gguf(configs(args.layers, args.vocab_size)["moe"], path, args.gguf_type)
    engines = {}
    for name, quantization in (("packed", "gguf"), ("dequantized", "none")):
        t0 = time.perf_counter()
        engines[name] = start_gguf(path, quantization, args)
        memory = engines[name].loaded.packed_memory
        held = memory.summary() if memory is not None else \
            f"{sum(p.numel() * p.element_size() for p in engines[name].loaded.model.parameters()) / 2**20:.0f} MiB " \
            "of dense parameters"
        print(f"  loaded {name} in {time.perf_counter() - t0:.1f} s: {held}", flush=True)
    print(f"{shapes} layer shapes x {args.layers} layers as a {kinds} GGUF ({path.stat().st_size / 2**20:.0f} "
          f"MiB), vocab {args.vocab_size}, context ~{args.context}, {engines['packed'].loaded.dtype}, "
          f"{torch.get_num_threads()} threads:")
    experts_alone(engines, args)
    for batch in (1, 16):
        for llm in engines.values():
            grow(llm, batch, args)
            step_seconds(llm, 2)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                times[name] += step_seconds(llm, args.steps)
        print(f" batch {batch}:")
        packed, dequantized = (report(name, times[name], batch) for name in ("packed", "dequantized"))
        fastest = min(times["dequantized"]) / min(times["packed"])
        print(f"  packed / dequantized: {packed / dequantized:.2f}x (medians), {fastest:.2f}x (fastest steps)")


def experts_alone(engines: dict[str, LLM], args: argparse.Namespace) -> None:
    """Layer 0's experts by themselves (router weights from its own router on random rows), the engines alternating:
    the part of a step the packing changes, without attention, the head or the engine around it."""
    calls = max(4, args.rounds * args.steps // 2)
    print(" layer 0's experts alone (ms a call: median, fastest):")
    for rows in (1, 16):
        x = torch.randn(rows, engines["packed"].loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {name: [] for name in engines}
        with torch.no_grad():
            blocks = {name: llm.loaded.model.layers[0].mlp for name, llm in engines.items()}
            inputs = {name: x.to(llm.loaded.dtype) for name, llm in engines.items()}
            routed = {name: block.route(inputs[name]) for name, block in blocks.items()}
            for _ in range(calls):
                for name, block in blocks.items():
                    t0 = time.perf_counter()
                    block.experts(inputs[name], *routed[name])
                    times[name].append(time.perf_counter() - t0)
        line = ", ".join(f"{name} {statistics.median(t) * 1e3:.2f} / {min(t) * 1e3:.2f}" for name, t in times.items())
        ratio = min(times["dequantized"]) / min(times["packed"])
        print(f"  {rows:2d} rows: {line}; packed {ratio:.2f}x faster (fastest calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="alternations of the two models")
    parser.add_argument("--steps", type=int, default=16, help="decode steps of one model per round")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--smoke", action="store_true", help="2 layers, 2 rounds of 3 steps")
    parser.add_argument("--packed-gguf", action="store_true",
                        help="packed GGUF experts vs the same file dequantized at load, batch 1 and 16 (CPU)")
    parser.add_argument("--gguf-type", default="Q4_K", help="--packed-gguf: the GGUF type of experts and attention")
    parser.add_argument("--gpt-oss", action="store_true",
                        help="--packed-gguf: gpt-oss-20b's shapes, MXFP4 experts (the rest Q8_0, dequantized)")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "kvpilot-bench"),
                        help="--packed-gguf: where its GGUF is written (once)")
    args = parser.parse_args()
    if args.packed_gguf:
        if args.layers == parser.get_default("layers"):
            args.layers = 1  # two copies in memory, the dequantized one ~3x the file; its load dominates the run
        if args.smoke:
            args.layers, args.rounds, args.steps, args.context = 1, 1, 2, 16
        main_packed_gguf(args)
        return
    if args.smoke:
        args.layers, args.rounds, args.steps, args.context = 2, 2, 3, 16
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for name, config in configs(args.layers, args.vocab_size).items():
            (Path(tmp) / name).mkdir()
            engines[name] = start(config, Path(tmp) / name, args)
            times[name] = []
        for name, llm in engines.items():
            step_seconds(llm, 2)  # warm-up
        for _ in range(args.rounds):
            for name, llm in engines.items():
                times[name] += step_seconds(llm, args.steps)
        loaded = engines["moe"].loaded
    print(f"Qwen3-30B-A3B layer shapes x {args.layers} layers, vocab {args.vocab_size}, batch {args.batch}, "
          f"context ~{args.context}, {loaded.dtype}, {loaded.device}, {torch.get_num_threads()} threads:")
    moe, dense = (report(name, times[name], args.batch) for name in ("moe", "dense"))
    print(f"  MoE / dense-equivalent: {moe / dense:.2f}x (goal >= 0.70x at batch 1)")


if __name__ == "__main__":
    main()
