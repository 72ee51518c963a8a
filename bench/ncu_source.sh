#!/usr/bin/env bash
# One device call: Nsight Compute's source page (SASS with sampled warp stalls) and summary of the
# small decode kernels (decode_header, validate_escapes) on one 256M-element decode. Carry .whl.
# Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ncu --clock-control none -k regex:'validate|decode_header' -c 2 --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --page source --print-source sass python3 bench/kernel_probe.py --once > $OUT/ncu_src.log 2>&1
echo rc=$?; wc -l $OUT/ncu_src.log; grep -c . $OUT/ncu_src.log
ncu --clock-control none -k regex:'validate|decode_header' -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats python3 bench/kernel_probe.py --once > $OUT/ncu_sum.log 2>&1
grep -E "Duration|Elapsed|SM Active|Block Size|Registers|Achieved Occ|Waves|Stall" $OUT/ncu_sum.log | head -60
