"""The C++ CPU kernels build together before a CPU model loads (kvpilot.model.cpu_kernels), each with the light
torch prelude (csrc/torch_prelude.h) in place of <torch/extension.h>."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpilot.model.cpu_kernels import build_cpu_kernels, kernels_for
from kvpilot.model.dtypes import cpu_has_fast_bf16
from kvpilot.model.layers.cpp_build import PRELUDE
from kvpilot.model.layers.cpu_prefill_kernel import get_prefill_kernel


def test_every_kernel_builds_with_the_prelude_and_has_its_functions() -> None:
    getters = kernels_for(torch.bfloat16)
    build_cpu_kernels(getters)
    # the prefill attention kernel is built with -march=native and exists only where the CPU has AVX512_BF16
    optional = set() if cpu_has_fast_bf16() else {get_prefill_kernel}
    built = {getter: getter() for getter in getters if getter not in optional}
    assert all(m is not None for m in built.values()), [g.__name__ for g, m in built.items() if m is None]
    names = [set(dir(m)) for m in built.values()]
    wanted_sets = [{"paged_decode"}, {"rms_norm_bf16", "rope_bf16", "silu_mul_bf16"}, {"decode_layers"}]
    for wanted in wanted_sets + ([] if optional else [{"prefill_attention_bf16"}]):
        assert any(wanted <= n for n in names), wanted
    assert "torch/extension.h" not in "".join(
        line for line in PRELUDE.read_text().splitlines() if line.startswith("#include"))


def test_native_bf16_follows_the_cpu_flags(tmp_path) -> None:
    zen4, zen3 = tmp_path / "zen4", tmp_path / "zen3"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n")
    zen3.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert cpu_has_fast_bf16(zen4) and not cpu_has_fast_bf16(str(zen3))
    assert not cpu_has_fast_bf16(tmp_path / "missing")


def test_float32_models_skip_the_bf16_kernels() -> None:
    assert set(kernels_for(torch.float32)) < set(kernels_for(torch.bfloat16))
    assert len(kernels_for(torch.float32)) == 3


def test_builds_run_side_by_side_and_all_finish() -> None:
    """Each build waits at a barrier for a second one: one after another, the first would wait forever."""
    meet = threading.Barrier(2, timeout=30)
    threads: set[str] = set()
    done: list[int] = []

    def build(i: int):
        def run() -> int:
            threads.add(threading.current_thread().name)
            meet.wait()
            done.append(i)
            return i
        return run

    build_cpu_kernels([build(i) for i in range(4)], max_workers=2)
    assert sorted(done) == [0, 1, 2, 3] and len(threads) == 2


def test_switched_off_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[bool] = []
    monkeypatch.setenv("KVPILOT_CPU_KERNELS", "0")
    build_cpu_kernels([lambda: called.append(True)])
    assert called == []


def test_a_first_compile_says_what_it_builds_and_that_it_happens_once(tmp_path, caplog) -> None:
    """Issue 46: a kernel with no cached build is announced (what, where, once) before the silent minute;
    a cached one is not."""
    import logging

    from kvpilot.model.layers.cpp_build import _announce_compile
    from kvpilot.model.layers.cpu_bf16_ops import _KERNEL

    with caplog.at_level(logging.INFO):
        assert _announce_compile(_KERNEL, tmp_path / "kvpilot_x", "kvpilot_x") is not None
    assert "compiling CPU bf16 ops kernel for this CPU: once, cached in" in caplog.text
    (tmp_path / "kvpilot_x").mkdir()
    (tmp_path / "kvpilot_x" / "kvpilot_x.so").write_bytes(b"")
    caplog.clear()
    assert _announce_compile(_KERNEL, tmp_path / "kvpilot_x", "kvpilot_x") is None and caplog.text == ""
