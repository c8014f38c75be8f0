"""Every Triton kernel (attention, plain and with the soft-cap/sinks/window variants, and the fused small ops)
compiles for Hopper (sm_90) with no GPU: what the interpreter cannot check (the compiler's typing, fp8
conversions, dot shapes, shared memory). Bfloat16 queries over a bf16 cache, and over an fp8 cache for the variants
whose code changes with it, at head dim 128, in a separate process (the interpreter must be off there);
`python tests/model/triton_sm90_compile.py --fp8-kv` compiles every dtype and head dim (minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model.triton_cases import TRITON_SKIP_REASON

H100_MAX_SHARED = 232_448  # bytes of shared memory one block may use on sm_90
SCRIPT = Path(__file__).with_name("triton_sm90_compile.py")


def _ptxas_missing() -> bool:
    import triton
    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(TRITON_SKIP_REASON is not None, reason=TRITON_SKIP_REASON or "")
def test_kernels_compile_for_hopper():
    if _ptxas_missing():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), "--head-dims", "128", "--dtypes", "bf16", "--fp8-kv"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    kernels = {"decode_split", "decode_single", "decode_reduce", "prefill", "kv_write", "decode_split_features",
               "decode_single_features", "decode_reduce_sinks", "prefill_features"}
    # fp8: the variants whose code reads the cache differently (triton_sm90_compile.FP8_DISTINCT), each once
    fp8 = {"decode_split", "decode_single", "prefill", "kv_write"}
    assert {(r["kernel"], r["kv_dtype"]) for r in records} == {(k, "bf16") for k in kernels} | {
        (k, "fp8e4nv") for k in fp8} | {(k, "bf16") for k in ("rms_norm", "rotary", "silu_mul", "quantize_fp8")}
    failed = [(r["kernel"], r["kv_dtype"], r.get("error")) for r in records if not r["compiled"]]
    assert not failed
    assert all(r["shared"] <= H100_MAX_SHARED for r in records)
    # the block-table width changes every step: a kernel specialized on it would compile again and again
    assert {r["kernel"] for r in records if "stride_bt" in r["unspecialized"]} == {
        "decode_split", "decode_single", "prefill", "decode_split_features", "decode_single_features", "prefill_features"}
