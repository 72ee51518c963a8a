#!/bin/bash
# Session 20, call 5: the connector harness, old tree (8f0c3fd) vs this one (spread copy + packed ids),
# interleaved, 4 rounds raw and one auto; then the one-block latency of both.
. bench/device_setup.sh
nvidia-smi -L
mkdir -p /tmp/old && tar -xzf bench/.prof/old20.tgz -C /tmp/old
H="--tokens 4096 --requests 30 --layout in-place"
for round in 1 2 3 4; do
  for tree in new old; do
    root=.; [ $tree = old ] && root=/tmp/old
    timeout 150 python3 $root/bench/vllm_gpu_harness.py $H --codec raw > /tmp/h.txt 2>&1
    echo "== harness raw $tree round $round" | tee -a $OUT/harness.txt; tail -5 /tmp/h.txt | tee -a $OUT/harness.txt
  done
done
for tree in new old; do
  root=.; [ $tree = old ] && root=/tmp/old
  timeout 150 python3 $root/bench/vllm_gpu_harness.py $H --codec auto > /tmp/h.txt 2>&1
  echo "== harness auto $tree" | tee -a $OUT/harness.txt; tail -5 /tmp/h.txt | tee -a $OUT/harness.txt
done
