#!/usr/bin/env bash
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/transport/test_checksum.py tests/engine/test_gpu_transfers.py \
  tests/engine/test_gpu_service.py tests/engine/test_leases.py tests/codec/test_blockcopy.py tests/client/test_vllm_core_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3
bash bench/.prof/tl.sh
HOP=0 TESTS=0 LATENCY=0 LATENCY_CPU=0 PEERS=1 SIZES=2M,64M,256M,1G,4G REPEATS=8 HARNESS=0 bash bench/lease_session.sh
