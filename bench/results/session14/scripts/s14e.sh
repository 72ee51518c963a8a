#!/usr/bin/env bash
# A/B: GPU chunks coded on the event loop (up to 256 MiB) or in worker threads (the old 256 KiB).
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
mkdir -p /tmp/kvprof/tlsite /tmp/kvtl && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
export PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
for inl in ${INLS:-262144 268435456 262144 268435456}; do
  export KVF_INLINE_GPU=$inl
  echo "===== inline GPU bytes $inl"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 2M,256M,1G --repeats 8 --codecs splitzip 2>&1 | grep "^| kvferry" | tee -a "$OUT/ab_$inl.md"
  timeout 250 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 1G,4G --repeats 6 --links 25,50 --link-min-bytes 1G --codecs splitzip 2>&1 | grep "GB/s | [14] GiB" | tee -a "$OUT/ab_$inl.md"
done
unset KVF_INLINE_GPU
[ "${TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py \
  tests/client/test_vllm_core_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
