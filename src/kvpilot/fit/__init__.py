"""kvpilot.fit: model and hardware catalogs, memory model and roofline (torch-free).

Entry points: `model_catalog.get_hf_config` (also used by the loader), `kv_cache` (the engine's KV sizing
contract), `model_source.load_model` + `plan.build_report` (what `kvpilot fit` prints), `cli.fit_command`.
kvpilot's one HF-config parser lives here too, below the model package that reuses it: `model_spec`
(shapes) + `runtime_spec` (rope, norm epsilon, token ids), and `gguf_metadata` (GGUF header -> HF config).
"""
