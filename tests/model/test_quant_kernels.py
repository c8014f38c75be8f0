"""The packed quantized-linear kernels (Q8_0, Q4_0, Q4_1) agree with dequantize-then-matmul to float32
rounding, on every ISA path this CPU runs (AVX-512, AVX2, portable), for an odd number of 32-blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvpilot.model.quant.formats import FORMATS
from kvpilot.model.quant.kernel import best_isa, get_quant_kernel, has_vnni
from kvpilot.model.quant.linear import INT8_MAX_ROWS, DenseScratch, PackedLinear
from kvpilot.model.quant.packed import PackedWeight
from kvpilot.model.quant.vnni_layout import dequantize_interleaved, interleave

pytestmark = pytest.mark.skipif(get_quant_kernel() is None, reason="no C++ compiler for the CPU kernels")

N, K = 37, 32 * 7  # N not a multiple of the 4-row tile, K an odd number of blocks (and not of 256)


def _random_packed(name: str, rows: int, cols: int, seed: int) -> tuple[PackedWeight, np.ndarray]:
    """Random weights quantized by the gguf package; returns the packed form and the gguf dequantization."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(values, T[name])
    return PackedWeight.from_blocks(raw, FORMATS[name]), dequantize(raw, T[name]).reshape(rows, cols)


def _fp32_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """The float32 rounding bound of K-term dot products: K * 2^-24 * sum |x_k w_k| (plus a tiny floor)."""
    return x.abs().double() @ torch.from_numpy(np.abs(w)).double().T * (w.shape[1] * 2.0 ** -24) + 1e-30


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_is_exact(name):
    packed, expected = _random_packed(name, N, K, seed=1)
    for isa in range(best_isa() + 1):
        assert np.array_equal(packed.dequantize(torch.float32, isa).numpy(), expected), isa
        bf16 = packed.dequantize(torch.bfloat16, isa)
        assert torch.equal(bf16, torch.from_numpy(expected).to(torch.bfloat16)), isa


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_matmul_matches_dequantized_reference(name, rows):
    packed, weights = _random_packed(name, N, K, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    reference = x.double() @ torch.from_numpy(weights).double().T
    bound = _fp32_bound(x, weights)
    for isa in range(best_isa() + 1):
        out = torch.empty(rows, N)
        packed.matmul_into(out, x, isa)
        error = (out.double() - reference).abs()
        assert bool((error <= bound).all()), f"isa {isa}: max error {error.max():.3g} > bound"


def test_fused_mixed_formats_write_side_by_side():
    """A fused projection of parts in different formats (q Q4_1, k Q8_0, v Q4_0) plus a bias, on the
    kernel path (few rows) and the dequantize + GEMM path (many rows) in float32 and bfloat16."""
    parts = [_random_packed(name, n, K, seed=i) for i, (name, n) in enumerate([("Q4_1", 20), ("Q8_0", 9),
                                                                               ("Q4_0", 11)])]
    layer = PackedLinear([p for p, _ in parts], bias=True, scratch=DenseScratch(), isa=best_isa())
    assert len(layer.parts) == 3 and layer.out_features == 40
    with torch.no_grad():
        layer.bias.copy_(torch.randn(40))
    weights = np.concatenate([w for _, w in parts])
    for rows in (2, 100):  # 2 rows: kernel; 100 rows: dequantized scratch + torch GEMM
        x = torch.randn(rows, K)
        reference = x.double() @ torch.from_numpy(weights).double().T + layer.bias.double()
        out = layer(x)
        assert bool(((out.double() - reference).abs() <= _fp32_bound(x, weights) + 1e-6).all()), rows
        out_bf16 = layer(x.to(torch.bfloat16)).double()
        torch.testing.assert_close(out_bf16, reference, rtol=0.05, atol=0.1 * float(reference.abs().mean()))


@pytest.mark.parametrize("int8", [False, True])
def test_bfloat16_rows_give_exactly_the_converted_float32_result(int8):
    """bf16 in and out inside the kernel (no torch conversions around it) must equal widening x to float32,
    running the float32 kernel, and rounding the result to bf16 (as the layer did before)."""
    if int8 and not has_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU")
    parts = [_random_packed("Q4_1", 21, K, seed=3)[0]] + ([] if int8 else [_random_packed("Q8_0", 9, K, seed=4)[0]])
    layer = PackedLinear(parts, bias=False, scratch=DenseScratch(), isa=best_isa(), int8_activations=int8)
    for rows in (1, 3, 16):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, layer(x.float()).to(torch.bfloat16)), rows


def test_same_format_parts_are_concatenated():
    parts = [_random_packed("Q4_1", n, K, seed=n)[0] for n in (12, 4, 4)]
    layer = PackedLinear(parts, bias=False, scratch=DenseScratch(), isa=best_isa())
    assert len(layer.parts) == 1 and layer.parts[0].out_features == 20


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("blocks", [7, 8, 18])  # only a tail, whole groups, the embedded model's K=576 (2 + tail)
def test_the_interleaved_copy_holds_the_same_values(name, blocks):
    """The int8 path's layout (8 blocks per group, chunk-interleaved, the tail in order, offsets folded in) holds
    exactly the gguf package's values, in as many bytes as the packed blocks' quants."""
    packed, expected = _random_packed(name, N, 32 * blocks, seed=blocks)
    copy = interleave(packed)
    assert copy.vq.shape == packed.qs.shape and copy.vd.shape == packed.d.shape
    assert np.array_equal(dequantize_interleaved(copy).numpy(), expected)


@pytest.mark.skipif(not has_vnni(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("name", list(FORMATS))
def test_int8_activations_agree_with_the_float32_kernel_to_the_activation_rounding(name):
    """The hybrid layout's few-row path (packed weights x int8 blocks, VNNI): each 32-value block of x is rounded
    to int8 with its own scale, so a dot product moves by at most sum_b max|x_b| / 254 * sum |w_b| (the bound
    asserted), while the float32 kernel stays at float32 rounding. Rows 1-5 cover the 4-row tiles and their
    remainder, K (7 blocks) the tail; the formats cover Q8_0's +128 storage and Q4_0's offset (-8 d)."""
    packed, w = _random_packed(name, N, K, seed=7)
    exact = PackedLinear([packed], bias=False, scratch=DenseScratch(), isa=best_isa())
    int8 = PackedLinear([packed], bias=False, scratch=DenseScratch(), isa=best_isa(), int8_activations=True)
    assert int8.int8_activations and not exact.int8_activations
    w_blocks = torch.from_numpy(np.abs(w)).view(N, K // 32, 32).sum(-1).double()  # [N, KB]
    for rows in (1, 2, 3, 5, INT8_MAX_ROWS):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        step = x.view(rows, K // 32, 32).abs().amax(-1).double() / 127  # one int8 step per block
        bound = (step / 2) @ w_blocks.T  # half a step per value, times |w| summed per block
        diff = (int8(x).double() - exact(x).double()).abs()
        assert bool((diff <= bound + 1e-4).all()) and float(diff.max()) > 0, rows  # rounded, within its bound
    more = torch.randn(INT8_MAX_ROWS + 1, K)  # more rows: the float32 kernel, as exact as ever
    assert torch.equal(int8(more), exact(more))
    other = "Q4_0" if name == "Q8_0" else "Q8_0"
    mixed = PackedLinear([packed, _random_packed(other, 4, K, seed=8)[0]], bias=False, scratch=DenseScratch(),
                         isa=best_isa(), int8_activations=True)
    assert not mixed.int8_activations  # parts of two formats: the float32 kernel


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    """A process killed while holding torch's build lock must not hang every later start."""
    import os

    from kvpilot.model.layers.cpp_build import STALE_BUILD_LOCK_S, STALE_CHECK_LOCK_S, remove_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    made = lock.stat().st_mtime
    assert not remove_stale_lock(tmp_path, "m", now=made + STALE_CHECK_LOCK_S + 1)  # a build may be running
    (tmp_path / "m.so").touch()
    assert not remove_stale_lock(tmp_path, "m", now=made + 1)  # someone checking the built module right now
    assert remove_stale_lock(tmp_path, "m", now=made + STALE_CHECK_LOCK_S + 1) and not lock.exists()
    lock.touch()
    os.remove(tmp_path / "m.so")
    assert remove_stale_lock(tmp_path, "m", now=lock.stat().st_mtime + STALE_BUILD_LOCK_S + 1)
    assert not remove_stale_lock(tmp_path, "m")  # no lock at all


def test_a_start_waits_for_another_build_says_so_and_ends_at_a_stale_lock(tmp_path, caplog) -> None:
    """A second process starting while one builds waits for its lock, saying why; a lock left by a killed
    builder (old, module built) ends the wait instead of hanging the start at "loading" for good."""
    import logging
    import os
    import threading

    from kvpilot.model.layers.cpp_build import STALE_CHECK_LOCK_S, wait_for_other_build
    from kvpilot.model.quant.kernel import _KERNEL

    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the builder finishes
    with caplog.at_level(logging.INFO):
        wait_for_other_build(_KERNEL, tmp_path, "m", poll_s=0.05)
    assert not lock.exists() and "waiting for another process building" in caplog.text
    lock.touch()
    (tmp_path / "m.so").touch()
    old = lock.stat().st_mtime - STALE_CHECK_LOCK_S - 5
    os.utime(lock, (old, old))  # its builder was killed a while ago
    wait_for_other_build(_KERNEL, tmp_path, "m", poll_s=0.05)
    assert not lock.exists()


def test_native_builds_are_named_per_cpu_and_portable_ones_are_not() -> None:
    """A -march=native module cached on one CPU must never load on another (illegal instructions there)."""
    from dataclasses import replace

    from kvpilot.model.layers.cpp_build import CppKernel, cpu_identity, module_name

    portable = CppKernel(label="k", name_prefix="k_", sources=(), functions=(), cflags=("-O3",), serial="",
                         fallback="")
    native = replace(portable, cflags=("-O3", "-march=native"))
    assert module_name(portable, "src", "cpu A") == module_name(portable, "src", "cpu B")
    assert module_name(native, "src", "cpu A") != module_name(native, "src", "cpu B")
    assert module_name(native, "src", "cpu A") != module_name(native, "src2", "cpu A")
    assert cpu_identity()  # something names this CPU


def test_environments_with_the_same_torch_share_a_module_and_others_do_not() -> None:
    """The name follows torch's build, not its install path: a fresh clone's virtual environment loads the
    module another environment built (the suite rebuilt every kernel in each fresh clone); another torch, or
    other compiler flags, get a module of their own."""
    from dataclasses import replace

    from kvpilot.model.layers.cpp_build import CppKernel, build_identity, module_name

    kernel = CppKernel(label="k", name_prefix="k_", sources=(), functions=(), cflags=("-O3",), serial="", fallback="")
    here = build_identity()
    assert torch.__version__ in here and ".venv" not in here and "/" not in here.split("\n")[0]
    assert module_name(kernel, "src", "cpu", here) == module_name(kernel, "src", "cpu", build_identity())
    assert module_name(kernel, "src", "cpu", "2.13.0+cpu") != module_name(kernel, "src", "cpu", "2.12.0+cpu")
    assert module_name(kernel, "src", "cpu", here) != module_name(replace(kernel, cflags=("-O2",)), "src", "cpu", here)


def test_a_built_module_loads_from_its_file_and_a_locked_or_missing_one_does_not(tmp_path: Path) -> None:
    """load_built imports the cached .so without torch's build step, unless a build holds the lock."""
    from torch.utils.cpp_extension import _get_build_directory

    from kvpilot.model.layers.cpp_build import load_built
    from kvpilot.model.quant.kernel import get_quant_kernel

    built = get_quant_kernel()
    if built is None:
        pytest.skip("no C++ toolchain here: the packed-linear kernel is not built")
    name = built.__name__
    module = load_built(Path(_get_build_directory(name, verbose=False)), name)
    assert module is not None and Path(module.__file__).name == f"{name}.so"
    assert load_built(tmp_path, name) is None  # nothing built there
    (tmp_path / f"{name}.so").write_bytes(b"")
    (tmp_path / "lock").touch()
    assert load_built(tmp_path, name) is None  # a build in progress: load_inline waits for it instead
