#!/bin/bash
# Session 20, call 1: the control lane against HTTP, same tree, interleaved (latency and harness).
. bench/device_setup.sh
nvidia-smi -L
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
for round in 1 2; do
  for control in http lane; do
    timeout 150 python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 2000 --long 0 --cpu-threads 0 \
      --control $control > $OUT/lat_${control}_$round.txt 2>&1
    echo "== latency $control round $round"; sed -n 4,8p $OUT/lat_${control}_$round.txt
  done
  for control in http lane; do
    timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --layout in-place --codec raw \
      --control $control --json $OUT/harness_${control}_$round.json > $OUT/harness_${control}_$round.txt 2>&1
    echo "== harness $control round $round"; tail -5 $OUT/harness_${control}_$round.txt
  done
done
timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --layout in-place --codec auto \
  --control lane --json $OUT/harness_auto_lane.json > $OUT/harness_auto_lane.txt 2>&1
echo "== harness auto lane"; tail -5 $OUT/harness_auto_lane.txt
