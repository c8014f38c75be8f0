"""The `kvpilot` command, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys

import pytest

KVPILOT = [sys.executable, "-m", "kvpilot.cli"]


def _run(*args: str, stdin: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*KVPILOT, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands_and_explains_flags():
    top = _run("--help")
    assert top.returncode == 0
    for command in ("generate", "chat", "fit", "bench"):
        assert command in top.stdout
    gen = _run("generate", "--help")
    text = " ".join(gen.stdout.replace("│", " ").split())  # the help's words, without rich's box and wrapping
    assert "--kv-cache-memory" in text and "Default: the embedded" in text and "--prompt-gemm-dtype" in text


@pytest.mark.slow
def test_generate_prints_the_greedy_completion():
    result = _run("generate", "What is the capital of France?", "--chat", "--max-tokens", "16", "--dtype", "float32",
                  "--kv-cache-memory", "512MiB", "--max-model-len", "1024")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."


@pytest.mark.slow
def test_chat_keeps_history_and_streams_replies():
    result = _run("chat", "--temperature", "0", "--max-tokens", "16", "--dtype", "float32", "--kv-cache-memory",
                  "512MiB", "--max-model-len", "1024",
                  stdin="What is the capital of France?\nAnd what did I just ask you?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert "The capital of France is Paris." in result.stdout
    assert result.stdout.count("\n") >= 3
    assert "INFO" not in result.stderr  # no log line without -v (tests/api/test_chat_session.py checks -v's)


def test_bad_model_path_is_one_clear_line():
    result = _run("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert result.returncode == 2
    assert "error: /nonexistent/model.gguf: no such GGUF file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_model_fails_before_torch_loads_or_a_port_is_bound():
    """Checked with the flags, not seconds later by the engine: `generate` never imports torch for it and
    `serve` never says it is loading."""
    probe = ("import sys\nfrom kvpilot.cli import main\nsys.argv = ['kvpilot', 'generate', 'hi', '--model', "
             "'/nonexistent/model.gguf']\ntry:\n    main()\nexcept SystemExit as exc:\n"
             "    print(exc.code, 'torch' in sys.modules)")
    generate = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert generate.stdout.split() == ["2", "False"], generate.stderr
    serve = _run("serve", "--model", "/nonexistent/dir", "--port", "0", timeout=60)
    assert serve.returncode == 2 and "loading" not in serve.stderr
    assert "error: /nonexistent/dir: no such file or directory. Pass a .gguf file" in serve.stderr
