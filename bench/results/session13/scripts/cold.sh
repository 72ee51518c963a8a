. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/.prof/cold.py 2>&1 | tee $OUT/cold.txt
mkdir -p /tmp/kvprof/site; cp bench/.prof/resolve_site.py /tmp/kvprof/site/sitecustomize.py
H="timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 40 --codec raw --layout in-place"
for i in 1 2; do
  rm -f /tmp/resolve.txt
  echo "== harness plain $i"; PYTHONPATH=/tmp/kvprof/site:$PYTHONPATH KVF_RES=1 $H 2>&1 | tail -4
  tail -n 6 /tmp/resolve.txt
  rm -f /tmp/resolve.txt
  echo "== harness with cpu_dma_latency=0 $i"
  python3 -c "
import os,struct,time,sys
fd=os.open('/dev/cpu_dma_latency',os.O_WRONLY); os.write(fd,struct.pack('i',0)); print('held',flush=True); time.sleep(170)" &
  P=$!; sleep 1
  PYTHONPATH=/tmp/kvprof/site:$PYTHONPATH KVF_RES=1 $H 2>&1 | tail -4
  tail -n 6 /tmp/resolve.txt
  kill $P
done
