#!/usr/bin/env bash
# One call on a lent GPU machine: the Triton kernels compiled and checked on the GPU, fp32 greedy against HF,
# then every figure of the GPU issue, a decode step's profile and the attention kernels alone. Each stage has
# its own time limit, so a hang or a crash costs only that stage; logs go to $OUT (one file a stage).
#
#     bash benchmarks/gpu_checks.sh [stage ...]     # stages: env tests fp32 throughput profile kernels
#                                                   # (default), profile1 profile1-torch-ops fp8 numerics server (carry .whl) ttft-torch
#                                                   # breakdown breakdown-sync (steps with prompts vs decode-only)
#                                                   # server-mp (the client in 4 processes), profile-mixed,
#                                                   # server-bench (kvpilot bench as the client: carry .whl and
#                                                   # .tok, see tokenizer_only_gguf.py), budget (token budgets);
#                                                   # PYSPY=1: the server stages sample the server with py-spy;
#                                                   # decode-splits (small-batch decode per split partition);
#                                                   # sync-debug (where eager async steps wait for the device)
#                                                   # disagg (#49: KV over CUDA IPC between two servers; .whl)
#                                                   # peers (#48: kvpilot vs nano-vllm, carry .peers: gpu_peers.py)
#     DEADLINE=$(( $(date +%s) + 570 )) bash benchmarks/gpu_checks.sh ...   # fit one device call's limit
#
# The machine needs torch (CUDA), triton and transformers; kvpilot runs from src/ without being installed.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export OUT=${OUT:-/tmp/kvpilot-gpu}
mkdir -p "$OUT"
PY=${PY:-python3}

stage() {  # stage NAME SECONDS command... (DEADLINE=epoch seconds: cut the limit to what is left, skip under 20 s)
    local name=$1 limit=$2
    shift 2
    if [ -n "${DEADLINE:-}" ]; then
        local left=$((DEADLINE - $(date +%s)))
        if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s left before DEADLINE"; return; fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "=== $name: start $(date -u +%T), limit ${limit}s"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: rc=$? end $(date -u +%T)"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
}

run_env() {
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
    $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
}

run_server() {  # kvpilot serve vs LLM.generate on one workload (needs .whl: benchmarks/gpu_wheels.sh, carried)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || return 1
    PYTHONPATH="/tmp/site:$PWD/.tok:$PYTHONPATH" $PY benchmarks/server_overhead.py --model qwen3-0.6b --load-format dummy \
        --kv-cache-memory '' --num-requests 512 --concurrency 256 --input-len 512 --output-len 256 \
        --max-model-len 1024 --server-log "$OUT/server-process-${CLIENT:-wire}-${CLIENT_PROCESSES:-1}.log" \
        --client-processes "${CLIENT_PROCESSES:-1}" --client "${CLIENT:-wire}" \
        ${PYSPY:+--py-spy "$OUT/spy-${CLIENT:-wire}-${CLIENT_PROCESSES:-1}.txt"} || return 1
    [ -z "${PYSPY:-}" ] || $PY benchmarks/pyspy_summary.py "$OUT/spy-${CLIENT:-wire}-${CLIENT_PROCESSES:-1}.txt" --top 12
}

run_disagg() {  # two `kvpilot serve` processes on the GPU move KV over CUDA IPC (needs .whl, as run_server)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || return 1
    PYTHONPATH="/tmp/site:$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider --timeout 240 \
        "tests/server/test_disaggregation_device.py::test_cuda_ipc_descriptor_round_trip_is_json" \
        "tests/server/test_disaggregation_device.py::test_cuda_ipc_between_two_gpu_servers"
}

run_tests() {  # TESTS="file ..." runs only those
    $PY -m pytest -q -p no:cacheprovider --timeout 120 ${TESTS:-tests/model/test_triton_attention.py \
        tests/model/test_triton_runner.py tests/model/test_triton_split.py tests/model/test_cuda_graphs.py \
        tests/model/test_piecewise_graphs.py \
        tests/model/test_triton_small_ops.py tests/model/test_device_staging.py tests/model/test_kv_groups_runner.py \
        tests/model/test_kv_scales.py tests/model/test_nccl_group.py}
}

export -f run_env run_tests run_server run_disagg
export PY
selected=("$@")
[ ${#selected[@]} -eq 0 ] && selected=(env tests fp32 throughput profile kernels)
for s in "${selected[@]}"; do
    case $s in
        env) stage env 60 bash -c run_env ;;
        tests) stage tests "${TESTS_LIMIT:-150}" bash -c run_tests ;;
        disagg) stage disagg 150 bash -c run_disagg ;;
        fp32) stage fp32 90 $PY benchmarks/gpu_throughput.py --smoke --dtype float32 ;;
        throughput) stage throughput "${THROUGHPUT_LIMIT:-260}" $PY benchmarks/gpu_throughput.py --hf-rows qwen3-b1 \
            --output "$OUT/throughput.json" ;;
        profile) stage profile "${PROFILE_LIMIT:-120}" $PY benchmarks/gpu_step_profile.py --model qwen3-0.6b --batch 256 --context 512 --profile --modes "${MODES:-sync-eager,async-eager,async-graphs}" ;;
        profile1) stage profile1 "${PROFILE_LIMIT:-60}" $PY benchmarks/gpu_step_profile.py --model qwen3-0.6b --batch 1 --context 512 --profile --modes "${MODES:-sync-eager,async-eager,async-graphs}" ;;
        breakdown) stage breakdown 150 $PY benchmarks/gpu_throughput.py --rows nano-vllm llama-ttft llama-ttft-16k \
            --skip-hf --step-breakdown ;;
        breakdown-sync) stage breakdown-sync 90 $PY benchmarks/gpu_throughput.py --rows nano-vllm --skip-hf \
            --step-breakdown --async-scheduling off ;;
        fp8) stage fp8 150 $PY benchmarks/gpu_throughput.py --rows llama-64 llama-b1 qwen3-b1 --skip-hf \
            --quantization fp8 ;;
        server) stage server 300 bash -c run_server ;;
        server-mp) CLIENT_PROCESSES=4 stage server-mp 300 bash -c run_server ;;
        server-bench) CLIENT=bench CLIENT_PROCESSES=${CLIENT_PROCESSES:-4} stage server-bench 300 bash -c run_server ;;
        budget) for b in ${BUDGETS:-8192 16384}; do stage budget-$b 90 $PY benchmarks/gpu_throughput.py \
            --rows nano-vllm llama-ttft --skip-hf --step-breakdown --max-num-batched-tokens "$b"; done ;;
        profile-mixed) stage profile-mixed "${PROFILE_LIMIT:-180}" $PY benchmarks/gpu_step_profile.py --model qwen3-0.6b \
            --batch 128 --context 512 --prefill-tokens 1900 --profile --modes "${MODES:-async-decode,async-graphs}" ;;
        numerics) stage numerics 120 $PY benchmarks/gpu_numerics.py ;;
        moe) stage moe "${MOE_LIMIT:-150}" $PY benchmarks/moe_decode.py --device cuda --batch 64 --layers 48 \
            --vocab-size 151936 --rounds 3 ;;  # #45: Qwen3-30B-A3B's shapes at full depth, goal >= 3,000 tok/s
        peers) stage peers "${PEERS_LIMIT:-300}" $PY benchmarks/gpu_peers.py --output "$OUT/peers.json" ;;
        kv-groups) stage kv-groups 120 $PY benchmarks/kv_groups.py --passes 1 ;;
        ttft-torch) stage ttft-torch 90 $PY benchmarks/gpu_throughput.py --rows llama-ttft --attention-backend torch ;;
        kernels) stage kernels 120 $PY benchmarks/attention_kernels.py --prefill-tiles 128x32x8x3 128x64x8x3 \
            64x64x4x3 128x128x8x3 64x128x8x3 128x64x4x4 ;;
        decode-splits) stage decode-splits 90 $PY benchmarks/attention_kernels.py --decode-partitions 16 32 64 128 \
            256 512 ;;
        sync-debug) stage sync-debug 90 $PY benchmarks/gpu_step_profile.py --model qwen3-0.6b --batch 256 --context 512 \
            --steps 10 --modes sync-eager,async-eager --sync-debug ;;
        profile1-torch-ops) KVPILOT_TRITON_OPS=0 stage profile1-torch-ops 60 $PY benchmarks/gpu_step_profile.py \
            --model qwen3-0.6b --batch 1 --context 512 --modes async-graphs ;;
        *) echo "unknown stage $s" ;;
    esac
done
