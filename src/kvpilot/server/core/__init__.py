"""The engine-core process: its step loop, channel and messages, the engine it builds, its KV-event
publisher. The HTTP side reaches it only through engine_client (and the messages, engine_spec and
engine_info types); tests/test_layering.py checks it."""
