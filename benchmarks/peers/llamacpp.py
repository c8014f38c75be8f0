"""llama.cpp as a peer: `llama-cpp-python[server]` built once from source with this CPU's flags.

llama-cpp-python's own server (`python -m llama_cpp.server`) serves one request at a time and has no
parallel-slots option. So the same build (same vendored llama.cpp, same flags, one compile) also builds
llama.cpp's C++ `llama-server`, kept in `<cache>/llamacpp-build`, which has `--parallel N` slots with
continuous batching: engine `llamacpp` runs that, engine `llamacpp-py` the Python server (one stream).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from peers.servers import ServerSpec
from peers.venvs import InstallError, PeerVenv

LLAMA_CPP_PYTHON = "llama-cpp-python[server]==0.3.36"
# GGML_NATIVE: -march=native (AVX-512, VNNI, BF16 where the CPU has them). The tools (llama-server) are
# off in llama-cpp-python's build; with them on, llama.cpp's tools/ adds mtmd itself (so LLAVA_BUILD, which
# adds it again, goes off: the Python package imports mtmd only for multimodal chat). The web UI would be
# fetched from the network, so it is left out.
BUILD_ARGS = ("-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAVA_BUILD=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
              "-DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
# On a CPU with AMX, -march=native also compiles ggml's AMX matmuls, whose worker threads run tile instructions
# without asking the kernel for the AMX state (Linux grants it per thread: XFD); llama-server then dies with SIGILL
# or SIGSEGV at its first matmul (a 2-vCPU Sapphire Rapids-class KVM guest, 2026-12-02; llama.cpp PR 26954, open).
# There the build names this CPU's AVX-512 features instead, as users of such machines build it.
AMX_SAFE_FEATURES = ("-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                     "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON")


@functools.cache
def cmake_args() -> str:
    """The CMake arguments of this machine's build: GGML_NATIVE, or without AMX (AMX_SAFE_FEATURES) on AMX CPUs."""
    from kvpilot.fit.fingerprint import cpu_flags

    features = AMX_SAFE_FEATURES if "amx_int8" in cpu_flags() else "-DGGML_NATIVE=ON"
    return f"{features} {BUILD_ARGS}"


KV_UNIFIED_FLAG = "--kv-unified"  # one KV buffer all slots share; older builds lack it (see llama_server_help)


def llamacpp_venv(cache_dir: Path) -> PeerVenv:
    return PeerVenv(cache_dir, "llamacpp")


def build_dir(cache_dir: Path) -> Path:
    return cache_dir / "llamacpp-build"


def install_llamacpp(cache_dir: Path, num_build_jobs: int) -> PeerVenv:
    """Builds and installs llama-cpp-python[server] (~10 min on 2 quiet cores) unless already installed.

    The sdist is unpacked once into the cache and built there with a kept build directory, so an
    interrupted compile resumes where it stopped (pip's temporary source folders would start it anew)."""
    venv = llamacpp_venv(cache_dir)
    if venv.is_installed() and f"CMAKE_ARGS={cmake_args()};" in venv.marker.read_text():
        return venv
    venv.create_fresh()
    source = _unpacked_sdist(venv, cache_dir)
    _drop_stale_build(cache_dir, source)
    env = {"CMAKE_ARGS": cmake_args(), "CMAKE_BUILD_PARALLEL_LEVEL": str(num_build_jobs), "FORCE_CMAKE": "1"}
    # --no-cache-dir: a wheel cached from a build without the kept build dir would skip llama-server.
    venv.pip(["install", "--no-cache-dir", f"--config-settings=build-dir={build_dir(cache_dir)}",
              f"{source}[server]"], "build and install llama-cpp-python[server]", env)
    server = find_llama_server(cache_dir)
    venv.mark_installed(f"{LLAMA_CPP_PYTHON}; CMAKE_ARGS={cmake_args()}; llama-server: {server}")
    return venv


def _unpacked_sdist(venv: PeerVenv, cache_dir: Path) -> Path:
    version = LLAMA_CPP_PYTHON.split("==")[1]
    source = cache_dir / "llamacpp-src" / f"llama_cpp_python-{version}"
    if (source / "pyproject.toml").is_file():
        return source
    downloads = cache_dir / "llamacpp-src" / "downloads"
    venv.pip(["download", "--no-deps", "--no-binary", ":all:", "-d", str(downloads), f"llama-cpp-python=={version}"],
             "download the llama-cpp-python sdist")
    archives = sorted(downloads.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not archives:
        raise InstallError(f"pip download left no llama_cpp_python-{version}.tar.gz in {downloads}")
    partial = source.with_name(source.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archives[0]) as archive:
        archive.extractall(partial, filter="data")
    (partial / source.name).rename(source)
    shutil.rmtree(partial)
    return source


def _drop_stale_build(cache_dir: Path, source: Path) -> None:
    """Keeps the build directory only if it was configured from `source` with today's cmake_args()."""
    build, stamp = build_dir(cache_dir), build_dir(cache_dir) / "kvpilot-build-stamp.txt"
    expected = f"{source}\n{cmake_args()}\n"
    if not (stamp.is_file() and stamp.read_text() == expected):
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        stamp.write_text(expected)


def find_llama_server(cache_dir: Path) -> Path:
    """The C++ llama-server binary of the kept build (linked to that build's shared libraries)."""
    found = sorted(p for p in build_dir(cache_dir).rglob("llama-server") if p.is_file() and os.access(p, os.X_OK))
    if not found:
        raise InstallError(f"no llama-server binary under {build_dir(cache_dir)}: delete {cache_dir / 'llamacpp'} "
                           "and rerun to rebuild")
    return found[0]


def llamacpp_server_spec(cache_dir: Path, gguf: Path, port: int, num_threads: int, max_parallel: int,
                         ctx_per_slot: int, kv_unified: bool = False) -> ServerSpec:
    """llama-server on the GGUF itself, `max_parallel` slots of `ctx_per_slot` tokens each (the context
    is sized slots x per-slot context: split between the slots, or with `kv_unified` one KV buffer all slots
    share, as llama-server runs when it picks its slot count itself), continuous batching."""
    command = [str(find_llama_server(cache_dir)), "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--threads", str(num_threads), "--threads-batch", str(num_threads),
               "--parallel", str(max_parallel), "--ctx-size", str(max_parallel * ctx_per_slot),
               "--cont-batching", "--alias", gguf.stem, "--no-webui",
               "--temp", "0"]  # greedy unless a request says otherwise (kvpilot bench may send no temperature)
    if kv_unified:
        command.append(KV_UNIFIED_FLAG)
    return ServerSpec("llamacpp", command, {}, port, "/health")


@functools.cache
def llama_server_help(cache_dir: Path) -> str:
    """`llama-server --help` of the kept build (its flags change between llama.cpp versions)."""
    done = subprocess.run([str(find_llama_server(cache_dir)), "--help"], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def has_flag(help_text: str, flag: str) -> bool:
    """Whether `flag` itself is listed (not merely a longer flag it begins, like --kv-unified-per-slot)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def llamacpp_py_server_spec(cache_dir: Path, gguf: Path, port: int, num_threads: int, ctx_size: int) -> ServerSpec:
    """llama-cpp-python's own server (one request at a time, as most of its users run it). It has no
    ignore_eos and no server-wide temperature: a stream may end early, and it samples at the request's
    temperature (0.8 when none is sent)."""
    venv = llamacpp_venv(cache_dir)
    command = [str(venv.python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(num_threads), "--n_threads_batch", str(num_threads),
               "--n_ctx", str(ctx_size), "--model_alias", gguf.stem]
    return ServerSpec("llamacpp-py", command, {}, port, "/v1/models")
