"""kvpilot.bench: a load generator for OpenAI-compatible servers that splits latency into stages.

Entry points: :func:`kvpilot.bench.api.run_bench` (programmatic) and
:func:`kvpilot.bench.cli.bench_command` (``kvpilot bench``). Modules, one concept each:
records (contracts), datasets + tokens (prompts), arrivals + load (load shapes), client + sse (one
timed request), runner (a run), scrape (server /metrics), stats + breakdown + clientlag (analysis),
sweep (knee), result + console + report_html (outputs), scripted_server + scripted_process (a
scripted OpenAI-compatible server for tests and the doctor). Result schema: docs/bench.md.
"""
