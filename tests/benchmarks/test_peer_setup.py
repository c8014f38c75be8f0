"""benchmarks/peers_cpu.py's setup without servers or peers installed: its arguments, the Q4_0 copy's name,
reuse and check, llama-server's flag detection, and each contender's server command."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest

import peers_cpu
from peers import llamacpp
from peers.comparisons import Contender, build_comparisons
from peers.kvpilot_engine import kvpilot_weight_args
from peers.llamacpp import KV_UNIFIED_FLAG, has_flag
from peers.quantize import ensure_q4_0_copy, is_current, q4_0_path, read_tensor_types, tensor_type_problems
from peers.venvs import InstallError
from peers.workloads import default_workloads

Q4_0, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0


def write_gguf(path: Path, matrix_type: gguf.GGMLQuantizationType = Q4_0) -> None:
    """A tiny GGUF: a Q8_0 embedding, one matrix of `matrix_type`, one F32 norm (bytes per row as stored)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 34), dtype=np.uint8), raw_dtype=Q8_0)
    row_bytes = {Q4_0: 18, Q8_0: 34, gguf.GGMLQuantizationType.Q4_1: 20}[matrix_type]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, row_bytes), dtype=np.uint8), raw_dtype=matrix_type)
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass
class FakeLlamaCppVenv:
    """Stands in for the llama.cpp venv: its `run` writes the tiny GGUF where the requantizer would."""

    root: Path
    matrix_type: gguf.GGMLQuantizationType = Q4_0
    commands: list[list[str]] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.root / "install.log"

    def run(self, command: list[str], step: str) -> None:
        self.commands.append(command)
        write_gguf(Path(command[3]), self.matrix_type)


def test_the_q4_0_copy_is_named_after_the_model_without_its_quantization(tmp_path):
    source = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert q4_0_path(tmp_path, source) == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_0.gguf"
    assert q4_0_path(tmp_path, Path("m.gguf")).name == "m.Q4_0.gguf"
    assert q4_0_path(tmp_path, Path("m.bf16.gguf")).name == "m.Q4_0.gguf"


def test_the_q4_0_copy_is_made_once_and_again_when_the_source_changes(tmp_path):
    source = tmp_path / "model.Q4_1.gguf"
    write_gguf(source, gguf.GGMLQuantizationType.Q4_1)
    venv = FakeLlamaCppVenv(tmp_path / "venv")
    copy = ensure_q4_0_copy(tmp_path / "cache", source, venv, num_threads=2)
    assert copy == q4_0_path(tmp_path / "cache", source) and copy.is_file() and is_current(copy, source)
    assert venv.commands[0][1].endswith("requantize_gguf.py") and venv.commands[0][2:] == [
        str(source), str(copy) + ".partial", "2"]
    assert not Path(str(copy) + ".partial").exists()
    assert ensure_q4_0_copy(tmp_path / "cache", source, venv, num_threads=2) == copy and len(venv.commands) == 1
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # an updated embedded model
    assert not is_current(copy, source)
    ensure_q4_0_copy(tmp_path / "cache", source, venv, num_threads=2)
    assert len(venv.commands) == 2 and is_current(copy, source)


def test_a_copy_with_the_wrong_types_is_refused_and_not_kept(tmp_path):
    source = tmp_path / "model.Q4_1.gguf"
    write_gguf(source, gguf.GGMLQuantizationType.Q4_1)
    venv = FakeLlamaCppVenv(tmp_path / "venv", matrix_type=Q8_0)
    with pytest.raises(InstallError, match="blk.0.attn_q.weight is Q8_0, expected Q4_0"):
        ensure_q4_0_copy(tmp_path / "cache", source, venv, num_threads=2)
    assert not q4_0_path(tmp_path / "cache", source).exists()


def test_tensor_types_of_a_q4_0_copy(tmp_path):
    write_gguf(tmp_path / "ok.gguf")
    types = read_tensor_types(tmp_path / "ok.gguf")
    assert types == {"token_embd.weight": ("Q8_0", 2), "blk.0.attn_q.weight": ("Q4_0", 2),
                     "blk.0.attn_norm.weight": ("F32", 1)}
    assert tensor_type_problems(types) == []
    assert tensor_type_problems({**types, "token_embd.weight": ("Q6_K", 2)}) == [
        "token_embd.weight is Q6_K, expected Q8_0"]
    assert tensor_type_problems({}) == ["no tensors"]


def test_kv_unified_is_found_only_as_itself():
    assert has_flag("-kvu,   --kv-unified, -no-kvu, --no-kv-unified   use single unified KV buffer", KV_UNIFIED_FLAG)
    assert not has_flag("--kv-unified-per-slot N   context limit per parallel slot", KV_UNIFIED_FLAG)
    assert not has_flag("-no-kvu, --no-kv-unified", KV_UNIFIED_FLAG)


def test_kvpilot_weight_arguments():
    assert kvpilot_weight_args("embedded", None) == []
    assert kvpilot_weight_args("bf16", None) == ["--quantization", "none", "--dtype", "bfloat16"]
    assert kvpilot_weight_args("q4_0", Path("/c/m.Q4_0.gguf")) == ["--model", "/c/m.Q4_0.gguf"]
    with pytest.raises(ValueError, match="Q4_0 copy"):
        kvpilot_weight_args("q4_0", None)


def test_parse_args_defaults_and_choices(capsys):
    args = peers_cpu.parse_args([])
    assert (args.comparisons, args.engines, args.passes) == (["default", "bf16", "q4_0"],
                                                             ["kvpilot", "llamacpp", "vllm"], 3)
    assert args.workloads == ["c1", "c16", "c64", "prefill"]
    args = peers_cpu.parse_args(["--comparisons", "q4_0, bf16,q4_0", "--workloads", "c1,c64", "--passes", "1",
                                 "--kvpilot-arg=--kv-cache-dtype=bfloat16"])
    assert (args.comparisons, args.workloads, args.passes) == (["q4_0", "bf16"], ["c1", "c64"], 1)
    assert args.kvpilot_arg == ["--kv-cache-dtype=bfloat16"]
    for bad, message in ((["--comparisons", "int8"], "--comparisons: unknown"), (["--passes", "0"], "at least 1"),
                         (["--engines", ""], "--engines: unknown or empty")):
        with pytest.raises(SystemExit):
            peers_cpu.parse_args(bad)
        assert message in capsys.readouterr().err


def test_uninstallable_peers_leave_their_comparisons():
    comparisons = build_comparisons(["default", "bf16", "q4_0"], ["kvpilot", "llamacpp", "vllm"])
    kept = peers_cpu.runnable(comparisons, {"vllm": "pip failed", "q4_0": "quantizer failed"})
    assert [(c.name, [p.label for p in c.peers]) for c in kept] == [("default", ["llamacpp"]), ("bf16", [])]
    only_peers = build_comparisons(["default"], ["vllm"])
    assert peers_cpu.runnable(only_peers, {"vllm": "no"}) == []


def spec(contender: Contender, tmp_path: Path, workload_names: tuple[str, ...] = ("c1", "c16", "c64"),
         extra: list[str] | None = None, kv_unified: bool = True):
    args = peers_cpu.parse_args(["--threads", "2", "--cache-dir", str(tmp_path)]
                                + [f"--kvpilot-arg={a}" for a in extra or []])
    setup = peers_cpu.Setup(Path("/e/model.Q4_1.gguf"), q4_0_gguf=Path("/c/model.Q4_0.gguf"), kv_unified=kv_unified)
    workloads = [w for w in default_workloads(False, 4) if w.name in workload_names]
    return peers_cpu.server_spec(contender, args, setup, workloads)


def test_kvpilot_contenders_differ_only_in_their_weights(tmp_path):
    default = spec(Contender("kvpilot", "kvpilot"), tmp_path, extra=["--kv-cache-memory=1GiB"])
    assert default.name == "kvpilot" and default.env == {"OMP_NUM_THREADS": "2"}
    assert default.command[-1] == "--kv-cache-memory=1GiB" and "--model" not in default.command
    bf16 = spec(Contender("kvpilot-bf16", "kvpilot", "bf16"), tmp_path)
    assert bf16.name == "kvpilot-bf16" and bf16.command[-4:] == ["--quantization", "none", "--dtype", "bfloat16"]
    q4_0 = spec(Contender("kvpilot-q4_0", "kvpilot", "q4_0"), tmp_path)
    assert q4_0.command[-2:] == ["--model", "/c/model.Q4_0.gguf"]


def test_llama_server_slots_follow_the_workload_on_q4_0(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "find_llama_server", lambda cache_dir: Path("/b/llama-server"))
    fair = Contender("llamacpp-q4_0", "llamacpp", "q4_0", slots_per_workload=True)
    c16 = spec(fair, tmp_path, ("c16",)).command
    assert c16[c16.index("--parallel") + 1] == "16" and c16[c16.index("--ctx-size") + 1] == str(16 * 512)
    assert c16[c16.index("--model") + 1] == "/c/model.Q4_0.gguf" and c16[-1] == KV_UNIFIED_FLAG
    assert KV_UNIFIED_FLAG not in spec(fair, tmp_path, ("c16",), kv_unified=False).command
    default = spec(Contender("llamacpp", "llamacpp"), tmp_path).command
    assert default[default.index("--parallel") + 1] == "64" and KV_UNIFIED_FLAG not in default
    assert default[default.index("--model") + 1] == "/e/model.Q4_1.gguf"


def test_fair_slots_start_one_server_per_workload(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(peers_cpu, "server_spec", lambda contender, args, setup, group: [w.name for w in group])
    monkeypatch.setattr(peers_cpu, "run_server", lambda label, index, spec, group, args, log: started.append(
        (label, index, spec, log.name)) or [])
    args = peers_cpu.parse_args([])
    workloads = default_workloads(True, 4)[:3]
    setup = peers_cpu.Setup(Path("m.gguf"))
    peers_cpu.run_contender(Contender("llamacpp-q4_0", "llamacpp", "q4_0", True), 5, args, setup, workloads, tmp_path)
    peers_cpu.run_contender(Contender("kvpilot-q4_0", "kvpilot", "q4_0"), 6, args, setup, workloads, tmp_path)
    assert started == [("llamacpp-q4_0", 5, ["c1"], "llamacpp-q4_0-5-c1-server.log"),
                       ("llamacpp-q4_0", 5, ["c16"], "llamacpp-q4_0-5-c16-server.log"),
                       ("llamacpp-q4_0", 5, ["c64"], "llamacpp-q4_0-5-c64-server.log"),
                       ("kvpilot-q4_0", 6, ["c1", "c16", "c64"], "kvpilot-q4_0-6-server.log")]
