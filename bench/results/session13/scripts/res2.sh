. bench/device_setup.sh
mkdir -p /tmp/kvprof/site; cp bench/.prof/resolve_site.py /tmp/kvprof/site/sitecustomize.py
ls /usr/local/cuda*/lib64/libcudart.so* 2>/dev/null | head -3
for b in "" 1; do
  rm -f /tmp/resolve.txt
  echo "== blocking sync: '$b'"
  PYTHONPATH=/tmp/kvprof/site:$PYTHONPATH KVF_RES=1 KVF_BLOCKING_SYNC=$b timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec raw --layout in-place 2>&1 | tail -3
  cat /tmp/resolve.txt
done
