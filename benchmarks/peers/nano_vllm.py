"""nano-vllm as the GPU peer of `gpu_peers.py`: a compact vLLM-style engine in Python (paged KV cache with
prefix caching, chunked prefill, CUDA graphs for decode, torch.compile'd norms, rotary and sampler), the one
whose bench shape gpu_throughput.py's first row copies.

Its source is never committed: `export_source` copies a pinned commit out of a git clone into an ignored
folder (.peers/nano-vllm), which a GPU call carries; nothing is installed. flash-attn, its one dependency the
GPU machine lacks, is replaced by `flash_attn_shim/` (Triton, this repository's). The child process runs its
`LLM` at the settings of nano-vllm's own bench.py (CUDA graphs on, max_model_len 4096, page 256), with the
GPU memory share the comparison gives it. Qwen3 only: nano-vllm implements no other architecture.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from peers.engine_child import Request

REPOSITORY = "https://github.com/GeeeekExplorer/nano-vllm"
PINNED_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"  # 2026-11: "chunked-prefill-refactor" merged
SHIM_DIR = Path(__file__).resolve().parent / "flash_attn_shim"
COMMIT_FILE = "COMMIT"
GREEDY_TEMPERATURE = 1e-6  # nano-vllm refuses temperature 0; at 1e-6 its sampler returns the argmax


def export_source(git_dir: Path, destination: Path, commit: str = PINNED_COMMIT) -> Path:
    """Writes `commit`'s tree of the nano-vllm clone at `git_dir` into `destination` (replaced), with a COMMIT file."""
    if not (git_dir / "HEAD").exists() and not (git_dir / ".git").exists():
        raise FileNotFoundError(f"{git_dir} is not a git repository: clone {REPOSITORY} (or fetch it) first")
    subprocess.run(["rm", "-rf", str(destination)], check=True)
    destination.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir" if (git_dir / "HEAD").exists() else "-C", str(git_dir), "archive",
                              commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    (destination / COMMIT_FILE).write_text(commit + "\n")
    return destination


def source_commit(source: Path) -> str:
    """The commit an exported source came from; refuses a folder that is not one."""
    if not (source / "nanovllm" / "llm.py").is_file():
        raise FileNotFoundError(f"{source} holds no nano-vllm source: run `python benchmarks/gpu_peers.py "
                                f"--export-source <nano-vllm clone>` first (see docs/benchmarks.md)")
    marker = source / COMMIT_FILE
    return marker.read_text().strip() if marker.is_file() else "unknown"


def child_pythonpath(source: Path) -> str:
    """The peer child's PYTHONPATH: the flash_attn stand-in first, then the nano-vllm source."""
    return os.pathsep.join([str(SHIM_DIR), str(source.resolve())])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_without_nccl() -> None:
    """nano-vllm joins a process group over NCCL at a fixed port even for one GPU; with one rank no collective
    runs (its layers all-reduce only when tp_size > 1), so gloo on a free port is the same engine without the
    NCCL set-up or a clash on port 2333."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(backend=None, init_method=None, world_size=-1, rank=-1, **kwargs):
        if world_size == 1:
            backend, init_method = "gloo", f"tcp://127.0.0.1:{_free_port()}"
        return original(backend, init_method, world_size=world_size, rank=rank, **kwargs)

    dist.init_process_group = init_process_group


class NanoVllmEngine:
    """The child side: nano-vllm's LLM on the model directory (needs CUDA, the source on sys.path)."""

    def __init__(self, model_dir: Path, max_model_len: int, gpu_memory_utilization: float) -> None:
        _one_rank_without_nccl()
        from nanovllm import LLM

        self._llm = LLM(str(model_dir), enforce_eager=False, max_model_len=max_model_len,
                        gpu_memory_utilization=gpu_memory_utilization)

    def generate(self, requests: list[Request], temperature: float) -> list[int]:
        from nanovllm import SamplingParams

        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
        outputs = self._llm.generate([p for p, _ in requests], params, use_tqdm=False)
        return [len(o["token_ids"]) for o in outputs]

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        from nanovllm import SamplingParams

        params = SamplingParams(temperature=GREEDY_TEMPERATURE, max_tokens=num_tokens, ignore_eos=True)
        return list(self._llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"])
