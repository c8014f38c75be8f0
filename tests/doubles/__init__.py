"""Test doubles: stand-ins for real servers, used by tests only (never shipped in the kvpilot package).

scripted_server: an OpenAI-compatible server whose timings and faults are scripted; scripted_process runs
it in its own process (``python -m tests.doubles.scripted_process``, from the repository root).
"""
