#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md on any CUDA machine with this repository checked out
# and installed (pip install -e '.[gpu,bench]'; nixl for the NIXL rows of `peers`).
#
#   bash bench/gpu_suite.sh RESULTS_DIR [part ...]      (default: every part; --help lists them)
#
# Each part writes its JSON (and a log) into RESULTS_DIR. Environment: UCX_TLS (default
# tcp,cuda_copy,cuda_ipc), REPEATS (peers, default 8), SIZES (peers, default 2M,256M,1G),
# LINKS (peers, default 12.5,25,50), TIMEOUT (seconds per command, default 600).
set -uo pipefail

PARTS="tests codec codecs entropy tcatbe quant seal latency peers harness e2e"
usage() {
    cat <<EOF
usage: bash bench/gpu_suite.sh RESULTS_DIR [part ...]
parts (default: all):
  tests     the GPU tests (pytest -m gpu)
  codec     SplitZip beside the device copy and nvCOMP (bench/codec_gpu.py)
  codecs    every registered codec on 1 GiB of blocks (bench/codec_gpu.py --seed-codecs)
  entropy   the entropy codec (bench/entropy_profile.py)
  tcatbe    the tca-tbe codec (bench/tcatbe_gpu_check.py)
  quant     k8v4 / k4v2 on blocks (bench/quant_gpu_check.py --blocks)
  seal      message authentication on host and GPU beside a device copy (bench/seal_cost.py)
  latency   one block, submit to done, tcp and ucxx (bench/latency.py)
  peers     kvferry beside NIXL, unpaced and on emulated links (bench/peers.py)
  harness   the vLLM connector's core between two GPU sidecars, one per GPU where there are two (bench/vllm_gpu_harness.py)
  e2e       auto against raw across emulated links, two GPUs if present (bench/e2e.py)
EOF
}
case "${1:-}" in -h|--help|"") usage; [ -n "${1:-}" ]; exit $? ;; esac
results=$1; shift
parts=${*:-$PARTS}
for part in $parts; do
    case " $PARTS " in *" $part "*) ;; *) echo "unknown part: $part" >&2; usage >&2; exit 2 ;; esac
done
cd "$(dirname "$0")/.."
mkdir -p "$results"
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc} PYTHONUNBUFFERED=1
limit=${TIMEOUT:-600}
failed=""

run() {  # run NAME COMMAND...: output to RESULTS_DIR/NAME.log, a failure noted and the suite goes on
    local name=$1; shift
    echo "=== $name: $*"
    if timeout "$limit" "$@" > "$results/$name.log" 2>&1; then tail -n 20 "$results/$name.log"
    else echo "$name failed (exit $?); see $results/$name.log"; tail -n 20 "$results/$name.log"; failed="$failed $name"; fi
}

python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU visible"' || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpus.txt"
gpus=$(wc -l < "$results/gpus.txt")
python3 - "$results/environment.json" <<'PY'
import json, platform, subprocess, sys, torch
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
           "python": platform.python_version(), "commit": commit}, open(sys.argv[1], "w"), indent=1)
PY

for part in $parts; do
    case $part in
        tests) run tests python3 -m pytest -q -p no:cacheprovider -m gpu tests ;;
        codec) run codec python3 bench/codec_gpu.py --json "$results/codec.json" ;;
        codecs) run codecs python3 bench/codec_gpu.py --seed-codecs 1G --repeats 5 --json "$results/codecs.json" ;;
        entropy) run entropy python3 bench/entropy_profile.py --repeats 9 --json "$results/entropy.json" ;;
        tcatbe) run tcatbe python3 bench/tcatbe_gpu_check.py --gib 1 --repeats 20 --json "$results/tcatbe.json" ;;
        quant) run quant python3 bench/quant_gpu_check.py --blocks --repeats 15 --json "$results/quant.json" ;;
        seal) run seal python3 bench/seal_cost.py --sizes 2M,64M,256M ;;
        latency)
            for backend in tcp ucxx; do
                timeout "$limit" python3 bench/latency.py --device cuda --backend $backend --block-kib 2048 --n 2000 \
                    --long 0 --cpu-threads 0 --json > "$results/latency_$backend.json" 2> "$results/latency_$backend.log" \
                    && echo "latency $backend: $results/latency_$backend.json" || { echo "latency $backend failed"; failed="$failed latency_$backend"; }
            done ;;
        peers)
            nixl=()
            python3 -c 'import nixl_cu13' 2>/dev/null || { echo "(no NIXL: kvferry rows only)"; nixl=(--no-nixl); }
            run peers python3 bench/peers.py --device cuda --backend ucxx --sizes "${SIZES:-2M,256M,1G}" \
                --repeats "${REPEATS:-8}" --links "${LINKS:-12.5,25,50}" --codecs raw,splitzip,auto \
                --link-min-bytes 1G "${nixl[@]}" --json "$results/peers.json" ;;
        harness)
            devices=cuda:0,cuda:0
            [ "$gpus" -ge 2 ] && devices=cuda:0,cuda:1  # a sidecar on each GPU, as deployed
            for codec in raw auto; do
                run "harness_$codec" python3 bench/vllm_gpu_harness.py --devices $devices --tokens 4096 \
                    --requests 20 --codec $codec --layout in-place --json "$results/harness_$codec.json"
            done ;;
        e2e)
            devices=auto
            [ "$gpus" -ge 2 ] && devices=cuda:0,cuda:1
            run e2e python3 bench/e2e.py --backend ucxx --tokens 8K,16K,32K,64K --devices $devices --budget-s 300 \
                --transfer-timeout 30 --out "$results/e2e.json" --plot "$results/e2e.png" ;;
    esac
done
if [ -n "$failed" ]; then echo "failed:$failed"; exit 1; fi
echo "all parts done; results in $results"
