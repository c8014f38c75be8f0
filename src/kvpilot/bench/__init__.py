"""kvpilot.bench: a load generator for OpenAI-compatible servers that splits latency into stages.

Entry points: :func:`kvpilot.bench.api.run_bench` (programmatic) and
:func:`kvpilot.bench.cli.make_bench_command` (``kvpilot bench``). Modules, one concept each:
records (contracts), datasets + tokens (prompts), arrivals + load (load shapes), client + sse (one
timed request), runner (a run), scrape (server /metrics), stats + breakdown + clientlag (analysis),
sweep (knee), result + console + report_html (outputs). Result schema: docs/bench.md. bench sits below
the doctor: the doctor's HTML section reaches the report through ``BenchConfig.report_sections``. The
scripted test server lives in tests/doubles.
"""
