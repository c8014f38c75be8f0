"""The physical limit for the measured workload, from `kvpilot fit` (``--model`` and ``--gpu``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.doctor.errors import DoctorInputError
from kvpilot.fit.calibration import load_profile
from kvpilot.fit.errors import FitError
from kvpilot.fit.hardware import parse_device_arg
from kvpilot.fit.model_source import load_model
from kvpilot.fit.plan import build_report
from kvpilot.fit.weight_formats import compute_dtype
from kvpilot.fit.workload import FitInputs


@dataclass(frozen=True)
class RooflineRef:
    """Upper bounds for ``model`` on ``gpu`` at the measured prompt/output lengths.

    ``decode_step_ms`` is the fastest possible batch-1 decode step (TPOT floor); ``ttft_ms`` the
    fastest prefill of the median prompt on an idle server; ``aggregate_tokens_per_s`` decode
    throughput at the measured peak concurrency (capped by what fits in the KV cache)."""

    model: str
    gpu: str
    decode_step_ms: float
    ttft_ms: float
    aggregate_tokens_per_s: float
    batch_size: int
    bound: str  # "memory bandwidth", "compute" or "step overhead" at batch 1
    dtype: str = "auto"  # weight/compute dtype the bound assumes ("auto": the model's own, bf16 for most)
    calibrated: bool = False  # this machine's measured rates (`kvpilot fit --calibrate`), not nominal ones
    calibration_note: str | None = None  # why a stored calibration profile was not used




def roofline_for(model: str, gpu: str, input_len: int, output_len: int, concurrency: int,
                 dtype: str | None = None, weight_dtype: str | None = None) -> RooflineRef:
    """``dtype``: what the server computes in (a float32 server reads twice the bytes of a bfloat16 one,
    so its floor is twice as high); ``weight_dtype``: the linear weights' format when quantized (int8, int4,
    fp8: fit's --weight-dtype; None: the checkpoint's own, a GGUF file's exact bytes). The device takes this
    machine's calibration profile when one was measured here (the doctor then judges by what this machine
    sustains: right for a server on the same host). Raises :class:`DoctorInputError` when fit cannot place the
    model (unknown name, does not fit)."""
    lookup = load_profile()
    try:
        fitted = load_model(model)
        # the server's dtype unknown: the checkpoint's own (bf16 for most), not the dtype kvpilot would pick on
        # this CPU; any engine may be serving
        report = build_report(fitted, parse_device_arg(gpu, profile=lookup.profile),
                              FitInputs(input_len=max(1, input_len), output_len=max(1, output_len),
                                        concurrency=max(1, concurrency),
                                        dtype=dtype or compute_dtype(fitted.spec), weight_dtype=weight_dtype or "auto"))
    except FitError as exc:
        raise DoctorInputError(f"--model/--gpu: {exc}") from exc
    rl = report.roofline
    if rl is None:
        raise DoctorInputError(f"--model {model} does not fit on --gpu {gpu} (see `kvpilot fit {model} "
                               f"--gpu {gpu}`), so it has no roofline to compare with")
    return RooflineRef(model=model, gpu=gpu, decode_step_ms=rl.decode_single.step_seconds * 1000.0,
                       ttft_ms=rl.ttft_seconds * 1000.0,
                       aggregate_tokens_per_s=rl.decode_at_concurrency.tokens_per_s_aggregate,
                       batch_size=rl.decode_at_concurrency.batch_size, bound=rl.decode_single.bound,
                       dtype=dtype or "auto", calibrated=report.group.device.calibrated,
                       calibration_note=lookup.note)


def limit_words(dtype: str | None, calibrated: bool | None) -> str:
    """How the verdict names the bound: "this machine's calibrated [dtype ]limit" (measured rates) or
    "the [dtype ]roofline" (nominal ones); the dtype only when explicit (not "auto": the model's own)."""
    word = f"{dtype} " if dtype and dtype != "auto" else ""
    return f"this machine's calibrated {word}limit" if calibrated else f"the {word}roofline"
