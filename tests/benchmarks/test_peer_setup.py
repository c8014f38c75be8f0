"""benchmarks/peers_cpu.py's setup without servers or peers installed: its arguments, the requantized copies'
names, reuse and type checks, llama-server's flag detection, each contender's server command, and the peak
RSS read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest

import peers_cpu
from peers import llamacpp
from peers.comparisons import Contender, build_comparisons
from peers.kvpilot_engine import kvpilot_weight_args
from peers.llamacpp import KV_UNIFIED_FLAG, has_flag
from peers.quantize import (IQ4_XS_MIX, Q4_0_MIX, Q4_K_M_MIX, REQUANTIZED_MIXES, QuantMix, RequantizedCopy,
                            ensure_requantized_copy, is_current, read_copy, read_tensor_types, requantized_path,
                            tensor_type_problems, type_mix)
from peers.servers import RunningServer
from peers.venvs import InstallError
from peers.workloads import Row, default_workloads

T = gguf.GGMLQuantizationType
COLUMNS = 256  # one K-quant super-block a row
# What each fake quantizer run writes for the matrices ({tensor: type}); the embedding is Q8_0 in every one.
Q4_0_FILE = {"blk.0.attn_q.weight": T.Q4_0, "blk.0.ffn_down.weight": T.Q4_0}
# llama.cpp's Q4_K_M on a model whose hidden size is not a multiple of 256: Q5_0 where Q4_K would not fit.
Q4_K_M_FILE = {"blk.0.attn_q.weight": T.Q5_0, "blk.0.attn_v.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q4_K,
               "blk.1.ffn_down.weight": T.Q6_K}
FILES = {"Q4_0": Q4_0_FILE, "Q4_K_M": Q4_K_M_FILE}


def write_gguf(path: Path, matrices: dict[str, gguf.GGMLQuantizationType]) -> None:
    """A tiny GGUF: a Q8_0 embedding, the `matrices` (32 rows of 256 weights each), one F32 norm."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, type_ in {"token_embd.weight": T.Q8_0, **matrices}.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[type_]
        rows = 64 if name == "token_embd.weight" else 32
        writer.add_tensor(name, np.zeros((rows, COLUMNS // block_size * type_size), dtype=np.uint8), raw_dtype=type_)
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros(COLUMNS, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass
class FakeLlamaCppVenv:
    """Stands in for the llama.cpp venv: its `run` writes, where the requantizer would, the tiny GGUF of the
    `--type` asked for (`files`), or `wrong` whatever the type."""

    root: Path
    wrong: dict[str, gguf.GGMLQuantizationType] | None = None
    commands: list[list[str]] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.root / "install.log"

    def run(self, command: list[str], step: str) -> None:
        self.commands.append(command)
        write_gguf(Path(command[3]), self.wrong or FILES[command[command.index("--type") + 1]])


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.Q4_1.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": T.Q4_1})
    return path


def test_copies_are_named_after_the_model_without_its_quantization(tmp_path):
    source = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert requantized_path(tmp_path, source, Q4_0_MIX) == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_0.gguf"
    assert requantized_path(tmp_path, source, Q4_K_M_MIX).name == "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    assert requantized_path(tmp_path, Path("m.gguf"), Q4_0_MIX).name == "m.Q4_0.gguf"
    assert requantized_path(tmp_path, Path("m.bf16.gguf"), Q4_K_M_MIX).name == "m.Q4_K_M.gguf"
    assert list(REQUANTIZED_MIXES) == ["q4_0", "q4_k_m", "iq4_xs"]


@pytest.mark.parametrize("mix, head_args", [(Q4_0_MIX, ["--head-type", "Q8_0"]), (Q4_K_M_MIX, [])])
def test_a_copy_is_made_once_and_again_when_the_source_changes(tmp_path, source, mix, head_args):
    venv = FakeLlamaCppVenv(tmp_path / "venv")
    copy = ensure_requantized_copy(tmp_path / "cache", source, mix, venv, num_threads=2)
    assert copy == requantized_path(tmp_path / "cache", source, mix) and copy.is_file()
    assert is_current(copy, source, mix)
    assert venv.commands[0][1].endswith("requantize_gguf.py") and venv.commands[0][2:] == [
        str(source), str(copy) + ".partial", "--type", mix.name, "--threads", "2", *head_args]
    assert not Path(str(copy) + ".partial").exists()
    assert ensure_requantized_copy(tmp_path / "cache", source, mix, venv, num_threads=2) == copy
    assert len(venv.commands) == 1
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # an updated embedded model
    assert not is_current(copy, source, mix)
    ensure_requantized_copy(tmp_path / "cache", source, mix, venv, num_threads=2)
    assert len(venv.commands) == 2 and is_current(copy, source, mix)


def test_a_copy_made_with_another_recipe_is_made_again(tmp_path, source):
    venv = FakeLlamaCppVenv(tmp_path / "venv")
    copy = ensure_requantized_copy(tmp_path / "cache", source, Q4_0_MIX, venv, num_threads=2)
    unpinned = QuantMix("Q4_0", Q4_0_MIX.matrix_types, Q4_0_MIX.core_types)  # the head left to llama.cpp
    assert not is_current(copy, source, unpinned)


def test_a_copy_with_the_wrong_types_is_refused_and_not_kept(tmp_path, source):
    venv = FakeLlamaCppVenv(tmp_path / "venv", wrong={"blk.0.attn_q.weight": T.Q8_0})
    with pytest.raises(InstallError, match="blk.0.attn_q.weight is Q8_0, expected Q4_0"):
        ensure_requantized_copy(tmp_path / "cache", source, Q4_0_MIX, venv, num_threads=2)
    assert not requantized_path(tmp_path / "cache", source, Q4_0_MIX).exists()


def test_tensor_types_of_a_q4_0_copy(tmp_path):
    write_gguf(tmp_path / "ok.gguf", Q4_0_FILE)
    types = read_tensor_types(tmp_path / "ok.gguf")
    assert types == {"token_embd.weight": ("Q8_0", 2), "blk.0.attn_q.weight": ("Q4_0", 2),
                     "blk.0.ffn_down.weight": ("Q4_0", 2), "blk.0.attn_norm.weight": ("F32", 1)}
    assert tensor_type_problems(types, Q4_0_MIX) == []
    assert tensor_type_problems({**types, "token_embd.weight": ("Q6_K", 2)}, Q4_0_MIX) == [
        "token_embd.weight is Q6_K, expected Q8_0"]
    assert tensor_type_problems({**types, "blk.0.attn_norm.weight": ("F16", 1)}, Q4_0_MIX) == [
        "blk.0.attn_norm.weight is F16, expected F32"]
    assert tensor_type_problems({}, Q4_0_MIX) == ["no tensors"]


def test_a_q4_k_m_copy_holds_only_llama_cpp_s_q4_k_m_types(tmp_path):
    write_gguf(tmp_path / "km.gguf", Q4_K_M_FILE)
    types = read_tensor_types(tmp_path / "km.gguf")
    assert tensor_type_problems(types, Q4_K_M_MIX) == []
    # The head is llama.cpp's choice (Q6_K where its rows are whole super-blocks), and Q5_K / Q5_1 may appear.
    assert tensor_type_problems({**types, "token_embd.weight": ("Q6_K", 2), "blk.2.attn_qkv.weight": ("Q5_K", 2),
                                 "blk.3.attn_qkv.weight": ("Q5_1", 2)}, Q4_K_M_MIX) == []
    assert tensor_type_problems({**types, "blk.0.attn_q.weight": ("Q4_0", 2)}, Q4_K_M_MIX) == [
        "blk.0.attn_q.weight is Q4_0, expected Q4_K or Q5_0 or Q5_1 or Q5_K or Q6_K or Q8_0"]
    no_k = {name: ("Q5_0", 2) for name in types}
    assert tensor_type_problems(no_k, Q4_K_M_MIX) == ["no Q4_K tensor: not a Q4_K_M file"]
    assert tensor_type_problems(types, Q4_0_MIX)[0] == "blk.0.attn_q.weight is Q5_0, expected Q4_0"


def test_an_iq4_xs_copy_holds_iq4_xs_where_rows_are_whole_super_blocks():
    """llama.cpp's IQ4_XS of the embedded model (2026-12-01): IQ4_NL on its 576-wide rows, IQ4_XS on ffn_down (1,536
    wide), a few ffn_down raised to Q5_K, the head Q8_0 as asked."""
    types = {"token_embd.weight": ("Q8_0", 2), "blk.0.attn_q.weight": ("IQ4_NL", 2),
             "blk.0.ffn_down.weight": ("Q5_K", 2), "blk.1.ffn_down.weight": ("IQ4_XS", 2),
             "blk.0.attn_norm.weight": ("F32", 1)}
    assert tensor_type_problems(types, IQ4_XS_MIX) == []
    assert tensor_type_problems({**types, "blk.1.ffn_down.weight": ("IQ4_NL", 2)}, IQ4_XS_MIX) == [
        "no IQ4_XS tensor: not a IQ4_XS file"]
    assert tensor_type_problems({**types, "token_embd.weight": ("Q6_K", 2)}, IQ4_XS_MIX) == [
        "token_embd.weight is Q6_K, expected Q8_0"]


def test_a_copy_is_described_by_its_tensor_bytes_and_type_mix(tmp_path):
    write_gguf(tmp_path / "km.gguf", Q4_K_M_FILE)
    copy = read_copy(tmp_path / "km.gguf")
    # 32 rows of 256 weights: Q5_0 8 x 22, Q8_0 8 x 34, Q4_K 144, Q6_K 210 bytes a row; the embedding 64 Q8_0 rows.
    assert copy.tensor_bytes == 32 * (176 + 272 + 144 + 210) + 64 * 272 + COLUMNS * 4
    assert copy.types == "Q8_0 x 2, Q5_0 x 1, Q4_K x 1, Q6_K x 1, F32 x 1"
    assert copy.describe().endswith(f"km.gguf (0.0 MiB of tensors: {copy.types})")
    assert type_mix({"a": ("Q4_K", 2), "b": ("Q6_K", 2), "c": ("Q4_K", 2)}) == "Q4_K x 2, Q6_K x 1"


def test_kv_unified_is_found_only_as_itself():
    assert has_flag("-kvu,   --kv-unified, -no-kvu, --no-kv-unified   use single unified KV buffer", KV_UNIFIED_FLAG)
    assert not has_flag("--kv-unified-per-slot N   context limit per parallel slot", KV_UNIFIED_FLAG)
    assert not has_flag("-no-kvu, --no-kv-unified", KV_UNIFIED_FLAG)


def test_kvpilot_weight_arguments():
    assert kvpilot_weight_args("embedded", None) == []
    assert kvpilot_weight_args("bf16", None) == ["--quantization", "none", "--dtype", "bfloat16"]
    assert kvpilot_weight_args("q4_0", Path("/c/m.Q4_0.gguf")) == ["--model", "/c/m.Q4_0.gguf"]
    assert kvpilot_weight_args("q4_k_m", Path("/c/m.Q4_K_M.gguf")) == ["--model", "/c/m.Q4_K_M.gguf"]
    with pytest.raises(ValueError, match="Q4_K_M copy"):
        kvpilot_weight_args("q4_k_m", None)
    with pytest.raises(ValueError, match="embedded, bf16 or one of q4_0, q4_k_m"):
        kvpilot_weight_args("int8", None)


def test_parse_args_defaults_and_choices(capsys):
    args = peers_cpu.parse_args([])
    assert (args.comparisons, args.engines, args.passes) == (["default", "bf16", "q4_0", "q4_k_m"],
                                                             ["kvpilot", "llamacpp", "vllm"], 3)
    assert args.workloads == ["c1", "c16", "c64", "prefill"]
    args = peers_cpu.parse_args(["--comparisons", "q4_k_m, bf16,q4_k_m", "--workloads", "c1,c64", "--passes", "1",
                                 "--kvpilot-arg=--kv-cache-dtype=bfloat16"])
    assert (args.comparisons, args.workloads, args.passes) == (["q4_k_m", "bf16"], ["c1", "c64"], 1)
    assert args.kvpilot_arg == ["--kv-cache-dtype=bfloat16"]
    for bad, message in ((["--comparisons", "int8"], "--comparisons: unknown"), (["--passes", "0"], "at least 1"),
                         (["--engines", ""], "--engines: unknown or empty")):
        with pytest.raises(SystemExit):
            peers_cpu.parse_args(bad)
        assert message in capsys.readouterr().err


def test_uninstallable_peers_or_copies_leave_their_comparisons():
    comparisons = build_comparisons(["default", "bf16", "q4_0", "q4_k_m"], ["kvpilot", "llamacpp", "vllm"])
    kept = peers_cpu.runnable(comparisons, {"vllm": "pip failed", "q4_0": "quantizer failed"})
    assert [(c.name, [p.label for p in c.peers]) for c in kept] == [("default", ["llamacpp"]), ("bf16", []),
                                                                    ("q4_k_m", ["llamacpp-q4_k_m"])]
    only_peers = build_comparisons(["default"], ["vllm"])
    assert peers_cpu.runnable(only_peers, {"vllm": "no"}) == []


def test_copies_are_made_with_their_mix_printed_and_a_bad_one_leaves_its_comparison(tmp_path, source, monkeypatch,
                                                                                    capsys):
    venv = FakeLlamaCppVenv(tmp_path / "venv")
    monkeypatch.setattr(peers_cpu, "llamacpp_venv", lambda cache_dir: venv)
    args = peers_cpu.parse_args(["--threads", "2", "--cache-dir", str(tmp_path / "cache")])
    setup = peers_cpu.Setup(source)
    peers_cpu.make_copies(args, setup, ["q4_0", "q4_k_m"])
    assert setup.failures == {} and set(setup.copies) == {"q4_0", "q4_k_m"}
    assert setup.gguf_for("q4_k_m") == requantized_path(tmp_path / "cache", source, Q4_K_M_MIX)
    assert setup.gguf_for("bf16") == setup.gguf_for("embedded") == source
    assert "Q8_0 x 2, Q5_0 x 1, Q4_K x 1, Q6_K x 1, F32 x 1" in capsys.readouterr().out

    venv.wrong = {"blk.0.attn_q.weight": T.Q4_0}  # a Q4_K_M asked, a file without K-quants made
    broken = peers_cpu.Setup(source)
    peers_cpu.make_copies(peers_cpu.parse_args(["--cache-dir", str(tmp_path / "other")]), broken, ["q4_k_m"])
    assert "Q4_0, expected Q4_K or" in broken.failures["q4_k_m"] and broken.copies == {}
    with pytest.raises(ValueError, match="need the Q4_K_M copy"):
        broken.gguf_for("q4_k_m")
    assert [c.name for c in peers_cpu.runnable(build_comparisons(["q4_0", "q4_k_m"], []), broken.failures)] == [
        "q4_0"]


def test_without_llama_cpp_no_copy_is_made(tmp_path, source):
    setup = peers_cpu.Setup(source, failures={"llamacpp": "compile failed"})
    peers_cpu.make_copies(peers_cpu.parse_args(["--cache-dir", str(tmp_path)]), setup, ["q4_0", "q4_k_m"])
    assert set(setup.failures) == {"llamacpp", "q4_0", "q4_k_m"} and setup.copies == {}
    assert peers_cpu.runnable(build_comparisons(["q4_0", "q4_k_m"], []), setup.failures) == []


def spec(contender: Contender, tmp_path: Path, workload_names: tuple[str, ...] = ("c1", "c16", "c64"),
         extra: list[str] | None = None, kv_unified: bool = True):
    args = peers_cpu.parse_args(["--threads", "2", "--cache-dir", str(tmp_path)]
                                + [f"--kvpilot-arg={a}" for a in extra or []])
    copies = {key: RequantizedCopy(Path(f"/c/model.{mix.name}.gguf"), 1, "") for key, mix in REQUANTIZED_MIXES.items()}
    setup = peers_cpu.Setup(Path("/e/model.Q4_1.gguf"), copies=copies, kv_unified=kv_unified)
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
    q4_k_m = spec(Contender("kvpilot-q4_k_m", "kvpilot", "q4_k_m"), tmp_path)
    assert q4_k_m.command[-2:] == ["--model", "/c/model.Q4_K_M.gguf"]


@pytest.mark.parametrize("key, file_type", [("q4_0", "Q4_0"), ("q4_k_m", "Q4_K_M")])
def test_llama_server_slots_follow_the_workload_on_a_requantized_copy(tmp_path, monkeypatch, key, file_type):
    monkeypatch.setattr(llamacpp, "find_llama_server", lambda cache_dir: Path("/b/llama-server"))
    fair = Contender(f"llamacpp-{key}", "llamacpp", key, slots_per_workload=True)
    c16 = spec(fair, tmp_path, ("c16",)).command
    assert c16[c16.index("--parallel") + 1] == "16" and c16[c16.index("--ctx-size") + 1] == str(16 * 512)
    assert c16[c16.index("--model") + 1] == f"/c/model.{file_type}.gguf" and c16[-1] == KV_UNIFIED_FLAG
    assert KV_UNIFIED_FLAG not in spec(fair, tmp_path, ("c16",), kv_unified=False).command
    # per-slot KV buffers (llama.cpp's own default with --parallel N) unless the run asks for one shared buffer
    assert not peers_cpu.parse_args([]).llama_kv_unified
    assert peers_cpu.parse_args(["--llama-kv-unified"]).llama_kv_unified
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
    peers_cpu.run_contender(Contender("llamacpp-q4_k_m", "llamacpp", "q4_k_m", True), 5, args, setup, workloads,
                            tmp_path)
    peers_cpu.run_contender(Contender("kvpilot-q4_k_m", "kvpilot", "q4_k_m"), 6, args, setup, workloads, tmp_path)
    assert started == [("llamacpp-q4_k_m", 5, ["c1"], "llamacpp-q4_k_m-5-c1-server.log"),
                       ("llamacpp-q4_k_m", 5, ["c16"], "llamacpp-q4_k_m-5-c16-server.log"),
                       ("llamacpp-q4_k_m", 5, ["c64"], "llamacpp-q4_k_m-5-c64-server.log"),
                       ("kvpilot-q4_k_m", 6, ["c1", "c16", "c64"], "kvpilot-q4_k_m-6-server.log")]


# A server stand-in: its child touches 64 MiB, frees it and says so; the peak stays in VmHWM.
CHILD = "import time; b = b'x' * (64 << 20); del b; print('ready', flush=True); time.sleep(60)"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"


def test_peak_rss_is_the_sum_of_the_server_processes_peaks():
    process = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        child, = psutil.Process(process.pid).children()
        child_peak = RunningServer("", child.pid).peak_rss_mib()
        tree_peak = RunningServer("http://127.0.0.1:1", process.pid).peak_rss_mib()
        assert child_peak is not None and child_peak >= 64  # freed before the read, still its peak
        assert tree_peak is not None and tree_peak - child_peak > 5  # the parent's interpreter counts too
    finally:
        os.killpg(process.pid, 9)
        process.wait()
    assert RunningServer("", process.pid).peak_rss_mib() is None  # gone


def test_each_row_carries_the_server_peak_rss(tmp_path, monkeypatch):
    workload = default_workloads(True, 4)[0]
    bench_row = Row("kvpilot", "c1", 0, 100.0, 1000.0, 5.0, 4.0, 4.0, 1, 0, 128.0, False, 128)
    monkeypatch.setattr(peers_cpu, "run_workload", lambda *args: bench_row)
    server = RunningServer("http://127.0.0.1:1", os.getpid())
    row = peers_cpu.measured_row("kvpilot", 0, server, workload, peers_cpu.parse_args(["--workloads", "c1"]), tmp_path)
    assert row.peak_rss_mib is not None and row.peak_rss_mib > 10 and row.output_tok_s == 100.0
    assert bench_row.peak_rss_mib is None


def test_a_vllm_without_its_tuned_preloads_is_named_with_every_figure(tmp_path, source, monkeypatch, capsys):
    """vLLM's CPU build is started with tcmalloc and its libiomp5 preloaded, as its users run it; where tcmalloc is
    not installed the setup records it, says so at once, and the note says what that does to the ratios."""
    monkeypatch.setattr(peers_cpu, "install_peers", lambda engines, cache_dir, gguf, num_build_jobs: {})
    monkeypatch.setattr(peers_cpu, "ld_preload", lambda venv: ("", ["tcmalloc (apt-get install x)"]))
    monkeypatch.setattr(peers_cpu, "vllm_venv", lambda cache_dir: None)
    args = peers_cpu.parse_args(["--cache-dir", str(tmp_path)])
    setup = peers_cpu.set_up(args, source, build_comparisons(["bf16"], []))
    assert setup.vllm_untuned == ["tcmalloc (apt-get install x)"]
    note = peers_cpu.untuned_note(setup.vllm_untuned)
    assert "tcmalloc" in note and "overstate kvpilot" in note and note in capsys.readouterr().out
    monkeypatch.setattr(peers_cpu, "ld_preload", lambda venv: ("/lib/tc.so:/venv/libiomp5.so", []))
    assert peers_cpu.set_up(args, source, build_comparisons(["bf16"], [])).vllm_untuned == []
