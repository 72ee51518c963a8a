#!/bin/bash
# Session 20: GPU tests of the spread copy, then the connector harness, old tree (8f0c3fd) vs
# this one, interleaved.
. bench/device_setup.sh
nvidia-smi -L
mkdir -p /tmp/old && tar -xzf bench/.prof/old20.tgz -C /tmp/old
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/codec/test_blockcopy.py tests/engine/test_leases.py \
  tests/engine/test_gpu_transfers.py tests/client/test_vllm_core_gpu.py > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
H="--tokens 4096 --requests 20 --layout in-place"
for round in 1 2 3; do
  for tree in old new; do
    root=.; [ $tree = old ] && root=/tmp/old
    timeout 150 python3 $root/bench/vllm_gpu_harness.py $H --codec raw > /tmp/h.txt 2>&1
    echo "== harness raw $tree round $round" | tee -a $OUT/harness.txt; tail -6 /tmp/h.txt | tee -a $OUT/harness.txt
  done
done
for tree in old new; do
  root=.; [ $tree = old ] && root=/tmp/old
  timeout 150 python3 $root/bench/vllm_gpu_harness.py $H --codec auto > /tmp/h.txt 2>&1
  echo "== harness auto $tree" | tee -a $OUT/harness.txt; tail -6 /tmp/h.txt | tee -a $OUT/harness.txt
done
