. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
mkdir -p /tmp/kvprof/site; cp bench/.prof/lane_site.py /tmp/kvprof/site/sitecustomize.py
for i in 1 2; do
  rm -f /tmp/lane.txt
  PYTHONPATH=/tmp/kvprof/site:$PYTHONPATH KVF_LANE=1 timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 30 --codec raw --layout in-place 2>&1 | tail -3
  cat /tmp/lane.txt
done
timeout 400 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 8 --links 25,50 --codecs splitzip \
   --json "$OUT/peers_links.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/peers_links.md" | tail -25
