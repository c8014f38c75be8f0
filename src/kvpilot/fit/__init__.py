"""kvpilot.fit: model and hardware catalogs, memory model and roofline (torch-free).

Entry points: `model_catalog.get_hf_config` (also used by the loader), `kv_cache` (the engine's KV sizing
contract), `model_source.load_model` + `plan.build_report` (what `kvpilot fit` prints), `cli.fit_command`.
"""
