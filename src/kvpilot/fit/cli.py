"""`kvpilot fit`: memory and roofline planner (registered by kvpilot.cli as `app.command("fit")`)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from kvpilot.fit.calibration import ProfileLookup, busy_note, load_profile, run_calibrator, save_profile
from kvpilot.fit.errors import FitError
from kvpilot.fit.hardware import GPUS, parse_device_arg
from kvpilot.fit.model_catalog import get_repo_id, list_models
from kvpilot.fit.model_source import LoadedModel, load_model
from kvpilot.fit.plan import build_report, compare_gpus, report_to_json
from kvpilot.fit.render import render_calibration, render_capacity_comparison, render_comparison, render_report
from kvpilot.fit.server_capacity import API_KEY_ENV, compare_capacity
from kvpilot.fit.workload import FitInputs
from kvpilot.memory_size import parse_memory_size


def _fail(message: str) -> typer.Exit:
    """One clear line on stderr, exit code 2 (bad input)."""
    print(f"kvpilot fit: error: {message}", file=sys.stderr)
    return typer.Exit(2)


def _memory_size(text: str | None) -> int | None:
    """'4GiB', '512MiB', '2GB' or a byte count (kvpilot's own size syntax); FitError otherwise."""
    if text is None:
        return None
    try:
        return parse_memory_size(text, "--kv-cache-memory")
    except ValueError as exc:
        raise FitError(str(exc)) from exc


def _print_catalogs(console: Console) -> None:
    console.print("[bold]Models[/bold]")
    for name in list_models():
        console.print(f"  {name:18} {get_repo_id(name)}")
    console.print("[bold]Devices[/bold] (--gpu NAME[:count])")
    for name, device in GPUS.items():
        console.print(f"  {name:18} {device.source}")
    console.print("  cpu                this machine (RAM from /proc/meminfo)")


CAPACITY_PATH = "/v1/kvpilot/capacity"


def fetch_server_capacity(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET the server's capacity JSON; FitError with one line saying what went wrong."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    endpoint = url.rstrip("/")
    if not endpoint.endswith(CAPACITY_PATH):
        endpoint += CAPACITY_PATH
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(endpoint, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise FitError(f"cannot reach the capacity endpoint {endpoint}: {exc or type(exc).__name__}; is "
                       "`kvpilot serve` running there?") from None
    if response.status_code == 401:
        raise FitError(f"the capacity endpoint {endpoint} answered HTTP 401 (API key missing or wrong): pass the "
                       "server's key with --api-key or set OPENAI_API_KEY")
    if response.status_code != 200:
        raise FitError(f"the capacity endpoint {endpoint} answered HTTP {response.status_code}: "
                       f"{response.text[:200].strip()}")
    try:
        payload = response.json()
    except ValueError:
        raise FitError(f"the capacity endpoint {endpoint} did not return JSON; is the server a kvpilot?") from None
    if not isinstance(payload, dict):
        raise FitError(f"the capacity endpoint {endpoint} returned {type(payload).__name__}, not an object")
    return payload


def _show_server_capacity(url: str, api_key: str | None, as_json: bool, console: Console) -> None:
    try:
        comparison = compare_capacity(fetch_server_capacity(url, api_key))
    except FitError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        _emit_json({"model": comparison.model, "matches": comparison.matches,
                    "predicted": comparison.predicted.to_json(), "actual": comparison.actual.to_json()})
    else:
        render_capacity_comparison(comparison, console)


def _emit_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2))


def _calibrate(as_json: bool, console: Console) -> None:
    """Measures this machine, stores the profile where fit and doctor look for it, prints it."""
    busy = busy_note()
    if busy is not None:
        print(f"kvpilot fit: warning: {busy}", file=sys.stderr)
    try:
        profile = run_calibrator()
        path = save_profile(profile)
    except (FitError, OSError) as exc:
        raise _fail(f"calibration failed: {exc}") from None
    if as_json:
        _emit_json({**profile.to_json(), "path": str(path)})
    else:
        render_calibration(profile, path, console)


def _note_calibration(lookup: ProfileLookup, as_json: bool, console: Console) -> None:
    """Why a stored profile was not used (printed on stderr under --json, so stdout stays one document)."""
    if lookup.note is None:
        return
    if as_json:
        print(f"kvpilot fit: note: {lookup.note}", file=sys.stderr)
    else:
        console.print(f"note: {lookup.note}", style="yellow", markup=False, highlight=False)


def _show_report(loaded: LoadedModel, gpu: str, cpu_bandwidth_gbps: float | None, inputs: FitInputs,
                 as_json: bool, console: Console) -> None:
    """The plan for one device group, on this machine's calibrated rates where it has them."""
    lookup = load_profile()
    report = build_report(loaded, parse_device_arg(gpu, cpu_bandwidth_gbps, lookup.profile), inputs)
    if as_json:
        _emit_json(report_to_json(report))
    else:
        render_report(report, console)
    _note_calibration(lookup, as_json, console)


def fit_command(
    model: Annotated[str, typer.Argument(
        help="Catalog name or HF repo id (see --list), a config.json or its directory, or a GGUF file."),
    ] = "smollm2-135m",
    gpu: Annotated[str, typer.Option("--gpu", "-g", help="Device NAME[:count], e.g. h100-sxm:8, l4, or cpu.")] = "cpu",
    weight_dtype: Annotated[str, typer.Option(
        help="Weight format: auto, fp32, bf16, fp16, fp8, int8, int4 or a GGUF type (q4_k, q8_0...).")] = "auto",
    dtype: Annotated[str, typer.Option(help="Activation dtype (vLLM --dtype): auto, bf16, fp16, fp32.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="KV cache dtype (vLLM --kv-cache-dtype): auto or fp8.")] = "auto",
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="Fraction of device memory the server may use (vLLM default 0.9).")] = 0.9,
    kv_cache_memory: Annotated[str | None, typer.Option(
        help="Fixed KV cache size per device, bytes or with a unit (4GiB), replacing the utilization "
             "fraction (vLLM --kv-cache-memory-bytes). Default on cpu: 2GiB, as kvpilot's engine.")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 1024,
    output_len: Annotated[int, typer.Option(help="Generated tokens per request.")] = 256,
    concurrency: Annotated[int, typer.Option(help="Target number of requests in flight.")] = 16,
    max_model_len: Annotated[int | None, typer.Option(
        help="Longest request to support (default: the model's max_position_embeddings).")] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(
        help="Tokens per engine step (sizes the activation peak).")] = 8192,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences per engine step (sizes the logits buffer).")] = 256,
    price_per_hour: Annotated[float | None, typer.Option(
        help="Price of one device per hour, for the cost per million output tokens.")] = None,
    cpu_bandwidth_gbps: Annotated[float | None, typer.Option(
        help="Memory bandwidth of this machine in GB/s for --gpu cpu (default 25, measured).")] = None,
    compare_gpus_: Annotated[bool, typer.Option(
        "--compare-gpus", help="Rank every catalog GPU for this model and workload.")] = False,
    url: Annotated[str | None, typer.Option(
        help="A running kvpilot server (http://host:port): show its actual KV capacity next to the "
             "prediction from its reported shape and KV budget (GET /v1/kvpilot/capacity).")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=list(API_KEY_ENV),
        help="With --url: the server's key (also read from OPENAI_API_KEY, then KVPILOT_API_KEY).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    list_catalog: Annotated[bool, typer.Option("--list", help="List catalog models and devices.")] = False,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this machine's memory bandwidth, GEMM rates and per-step overhead with "
                            "kvpilot's kernels (under a minute) and store them: fit's and doctor's rooflines "
                            "then use them for the CPU and this machine's GPU.")] = False,
) -> None:
    """Plan memory and speed for a model on given hardware: does it fit, KV capacity, roofline, flags."""
    console = Console()
    if list_catalog:
        _print_catalogs(console)
        return
    if calibrate:
        _calibrate(as_json, console)
        return
    if url is not None:
        _show_server_capacity(url, api_key, as_json, console)
        return
    try:
        inputs = FitInputs(
            weight_dtype=weight_dtype, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=_memory_size(kv_cache_memory),
            input_len=input_len, output_len=output_len, concurrency=concurrency, max_model_len=max_model_len,
            block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            price_per_hour=price_per_hour,
        ).validate()
        loaded = load_model(model)
        if compare_gpus_:
            rows = compare_gpus(loaded, inputs)
            if as_json:
                _emit_json([{"gpu": r.gpu, "tokens_per_s_per_device": r.tokens_per_s_per_device,
                             "report": report_to_json(r.report) if r.report else None} for r in rows])
            else:
                render_comparison(rows, console)
            return
        _show_report(loaded, gpu, cpu_bandwidth_gbps, inputs, as_json, console)
    except FitError as exc:
        raise _fail(str(exc)) from None
