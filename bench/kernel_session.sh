#!/usr/bin/env bash
# One device call for kernel work on the GPU codec: carry .whl. Runs the codec's GPU tests, the
# kernel probe (bench/kernel_probe.py, arguments passed on), then Nsight Compute over one call of
# each kernel. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
uname -r
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -m gpu tests/codec 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
python3 bench/kernel_probe.py "$@" 2>&1 | tee "$OUT/probe.log"
if [ -z "${NO_NCU:-}" ]; then
  ncu --clock-control none -k regex:'like_|encode_lean|decode_lean|encode_tail|validate|decode_header' \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section SchedulerStats --print-details all \
      python3 bench/kernel_probe.py --once > "$OUT/ncu.log" 2>&1
  grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Stall [A-Z]" "$OUT/ncu.log" | head -150
fi
