"""A fix the server already has is no fix: fixes whose flags equal the server's current settings are dropped.

Rules write fixes from their symptom ("throughput is flat: --max-num-seqs 256"); only the server's own
report of its settings (kvpilot's capacity endpoint, vLLM's cache_config_info, the --serve flags: a
:class:`~kvpilot.doctor.server_config.ServerConfig`) says whether that is what it runs with already. Telling
a server that reports ``max_num_seqs`` 256 to pass ``--max-num-seqs 256`` sends the user to restart with the
same command, and ``--verify`` would measure nothing.

A fix is a no-op when every flag of its kvpilot (or vLLM) text names a setting the server reports, with the
value it reports. A flag the server does not report, or text that is not plain flags (placeholders such as
``<larger>``, prose), keeps the fix.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import replace

from kvpilot.doctor.findings import Finding, Fix
from kvpilot.doctor.server_config import ServerConfig
from kvpilot.memory_size import parse_memory_size


def _int_of(field: str) -> Callable[[ServerConfig, str | None], bool | None]:
    def same(cfg: ServerConfig, value: str | None) -> bool | None:
        current = getattr(cfg, field)
        if current is None or value is None:
            return None
        try:
            return int(value) == current
        except ValueError:
            return None
    return same


def _caching(on: bool) -> Callable[[ServerConfig, str | None], bool | None]:
    def same(cfg: ServerConfig, value: str | None) -> bool | None:
        return None if cfg.enable_prefix_caching is None else cfg.enable_prefix_caching is on
    return same


def _kv_memory(cfg: ServerConfig, value: str | None) -> bool | None:
    if cfg.kv_cache_memory_bytes is None or value is None:
        return None
    try:
        return parse_memory_size(value, "--kv-cache-memory") == cfg.kv_cache_memory_bytes
    except ValueError:
        return None


def _text_of(field: str) -> Callable[[ServerConfig, str | None], bool | None]:
    def same(cfg: ServerConfig, value: str | None) -> bool | None:
        current = getattr(cfg, field)
        return None if current is None or value is None else current.lower() == value.lower()
    return same


# flag -> whether ``value`` is what the server runs with (None: the server does not report it)
SETTINGS: dict[str, Callable[[ServerConfig, str | None], bool | None]] = {
    "--max-num-seqs": _int_of("max_num_seqs"),
    "--max-model-len": _int_of("max_model_len"),
    "--max-num-batched-tokens": _int_of("max_num_batched_tokens"),
    "--block-size": _int_of("block_size"),
    "--enable-prefix-caching": _caching(True),
    "--no-enable-prefix-caching": _caching(False),
    "--kv-cache-memory": _kv_memory,
    "--quantization": _text_of("quantization"),
}


def plain_flags(text: str, placeholders: bool = False) -> list[tuple[str, str | None]] | None:
    """``--flag [value]`` pairs of a fix text; None when it is not plain flags (a value such as ``<lower>`` counts
    as one with `placeholders`: a setting to choose, which another engine's flag names as well)."""
    if not text.startswith("--") or ("<" in text and not placeholders) or "(" in text:
        return None
    # a placeholder of several words ("<longest real request>") stays one value
    text = re.sub(r"<[^<>]*>", lambda m: m.group(0).replace(" ", "\x00"), text)
    try:
        words = [w.replace("\x00", " ") for w in shlex.split(text)]
    except ValueError:
        return None
    out: list[tuple[str, str | None]] = []
    for i, word in enumerate(words):
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            nxt = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            out.append((name, value if eq else nxt))
    return out


def is_noop(fix: Fix, cfg: ServerConfig) -> bool:
    """Whether every flag of the fix's kvpilot text (else its vLLM text) is the server's current setting."""
    for text in (fix.kvpilot, fix.vllm):
        flags = plain_flags(text)
        if flags:
            return all(name in SETTINGS and SETTINGS[name](cfg, value) is True for name, value in flags)
    return False


def drop_noop_fixes(findings: list[Finding], cfg: ServerConfig | None) -> list[Finding]:
    """``findings`` without the fixes the server already has (unchanged without a server config)."""
    if cfg is None:
        return findings
    return [replace(f, fixes=kept) if len(kept := tuple(x for x in f.fixes if not is_noop(x, cfg))) < len(f.fixes)
            else f for f in findings]
