"""The `kvpilot` command: serve, generate, chat, bench, fit, doctor, proxy."""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Optional

import typer

from kvpilot.bench.cli import make_bench_command
from kvpilot.cli_options import (DeviceOpt, DownloadDirOpt, DtypeOpt, GgufFileOpt, KvCacheDtypeOpt,
                                 KvCacheMemoryOpt, KvOffloadDirOpt, KvOffloadDirSizeOpt, KvOffloadingSizeOpt,
                                 KvOffloadOverlapOpt, LoadFormatOpt, MaxModelLenOpt, ModelOpt, PromptGemmDtypeOpt,
                                 QuantizationOpt, RevisionOpt, SeedOpt, SpeculativeConfigOpt)
from kvpilot.doctor.bench_section import doctor_report_section
from kvpilot.doctor.cli import doctor_command
from kvpilot.fit.calibration import MachineProfile, set_calibrator
from kvpilot.fit.cli import fit_command
from kvpilot.fit.serve_command import set_serve_check
from kvpilot.model.config import unsupported_reason
from kvpilot.server.cli import serve_command
from kvpilot.server.disagg.cli import proxy_command


def _calibrate() -> MachineProfile:
    from kvpilot.calibrate import calibrate  # torch and the engine load only when measuring

    return calibrate()


app = typer.Typer(help="kvpilot: a fast LLM inference server that explains its own speed.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("serve")(serve_command)
set_serve_check(unsupported_reason)  # fit prints `kvpilot serve` lines only for models the registry runs
set_calibrator(_calibrate)  # `kvpilot fit --calibrate` measures with kvpilot's kernels; fit stays torch-free
app.command("fit")(fit_command)
app.command("bench")(make_bench_command((doctor_report_section,)))  # the HTML report carries the diagnosis
app.command("doctor")(doctor_command)
app.command("proxy")(proxy_command)


def _build_llm(kwargs: dict[str, object]):
    """Builds the LLM, turning user errors (bad model, bad flag) into one clear line and exit code 2."""
    from kvpilot.engine.config import EngineConfigError
    from kvpilot.model.errors import ModelLoadError
    from kvpilot.model.hub import check_local_model

    try:
        check_local_model(kwargs.get("model"), str(kwargs.get("load_format", "auto")))  # before torch loads
        from kvpilot.llm import LLM

        return LLM(**kwargs)
    except (ModelLoadError, EngineConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text (raw, no chat template; see `kvpilot chat`).")],
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k likeliest tokens; 0 or -1 = off.")] = -1,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="Seed of the sampling stream.")] = None,
    chat_template: Annotated[bool, typer.Option("--chat/--raw", help="Apply the chat template to the prompt.")] = False,
    model: ModelOpt = None, load_format: LoadFormatOpt = "auto", dtype: DtypeOpt = "auto", device: DeviceOpt = None,
    max_model_len: MaxModelLenOpt = None, kv_cache_memory: KvCacheMemoryOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto", seed: SeedOpt = 0, quantization: QuantizationOpt = "auto",
    prompt_gemm_dtype: PromptGemmDtypeOpt = "auto", revision: RevisionOpt = None,
    download_dir: DownloadDirOpt = None, gguf_file: GgufFileOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
) -> None:
    """Generate a completion for one prompt and print it (streamed as it is produced)."""
    from kvpilot.sampling_params import SamplingParams

    llm = _build_llm(dict(model=model, load_format=load_format, dtype=dtype, device=device,
                           max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                           kv_cache_dtype=kv_cache_dtype, seed=seed, quantization=quantization,
                           prompt_gemm_dtype=prompt_gemm_dtype, revision=revision, download_dir=download_dir,
                           gguf_file=gguf_file, speculative_config=speculative_config))
    params = _sampling_params(SamplingParams, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=sample_seed)
    prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat_template else prompt
    for output in llm.stream(prompt_ids, params):
        sys.stdout.write(output.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _sampling_params(cls, **kwargs):
    try:
        return cls(**kwargs)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def chat(
    system: Annotated[Optional[str], typer.Option("--system", help="System message (default: the template's).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 0.9,
    model: ModelOpt = None, load_format: LoadFormatOpt = "auto", dtype: DtypeOpt = "auto", device: DeviceOpt = None,
    max_model_len: MaxModelLenOpt = None, kv_cache_memory: KvCacheMemoryOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto", seed: SeedOpt = 0, quantization: QuantizationOpt = "auto",
    prompt_gemm_dtype: PromptGemmDtypeOpt = "auto", revision: RevisionOpt = None,
    download_dir: DownloadDirOpt = None, gguf_file: GgufFileOpt = None,
    speculative_config: SpeculativeConfigOpt = None, kv_offloading_size: KvOffloadingSizeOpt = None,
    kv_offload_dir: KvOffloadDirOpt = None, kv_offload_dir_size: KvOffloadDirSizeOpt = None,
    kv_offload_overlap: KvOffloadOverlapOpt = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the engine's INFO log lines.")] = False,
) -> None:
    """Interactive chat in the terminal with line editing and history; replies stream token by token. Ctrl-C
    stops a reply, Ctrl-D or /exit quits, /reset clears the history."""
    from kvpilot.chat_session import run_chat
    from kvpilot.sampling_params import SamplingParams

    if not verbose:  # a conversation, not a server log: warnings and errors only
        logging.getLogger().setLevel(logging.WARNING)
    llm = _build_llm(dict(model=model, load_format=load_format, dtype=dtype, device=device,
                           max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                           kv_cache_dtype=kv_cache_dtype, seed=seed, quantization=quantization,
                           prompt_gemm_dtype=prompt_gemm_dtype, revision=revision, download_dir=download_dir,
                           gguf_file=gguf_file, speculative_config=speculative_config,
                           kv_offloading_size=kv_offloading_size, kv_offload_dir=kv_offload_dir,
                           kv_offload_dir_size=kv_offload_dir_size, kv_offload_overlap=kv_offload_overlap))
    params = _sampling_params(SamplingParams, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    run_chat(llm, params, system)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()



if __name__ == "__main__":
    main()
