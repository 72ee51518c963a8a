#!/bin/bash
# Session 20, call 2: where the connector harness's transfer ends (split by both sidecars' records),
# then a timeline of 6 harness requests (sitecustomize tl_site20.py in every process).
. bench/device_setup.sh
nvidia-smi -L
for round in 1 2; do
  timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --layout in-place --codec raw \
    > $OUT/harness_$round.txt 2>&1
  echo "== harness raw round $round"; tail -6 $OUT/harness_$round.txt
done
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite && cp bench/.prof/tl_site20.py /tmp/kvprof/tlsite/sitecustomize.py
rm -f /tmp/kvtl/*
KVF_TL=1 PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 \
  --requests 6 --layout in-place --codec raw > $OUT/harness_tl.txt 2>&1
tail -6 $OUT/harness_tl.txt
python3 bench/.prof/tl.py /tmp/kvtl 3 > $OUT/tl.txt
wc -l $OUT/tl.txt
cat $OUT/tl.txt | head -150
