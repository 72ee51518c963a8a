#!/usr/bin/env bash
# One device call for bench/peers.py: kvferry (raw, splitzip, auto) beside NIXL, two processes on
# one GPU (the same host: kvferry writes over CUDA IPC, NIXL's UCX over cuda_ipc). Carry .whl-svc,
# .whl-ucx and .whl-nixl (bench/make_device_bundles.sh). Usage there: bash bench/peers_session.sh
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import nixl_cu13, ucxx; print("nixl", nixl_cu13.__file__, "ucxx", ucxx.__version__)'
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
timeout 540 python3 bench/peers.py --device cuda --backend ucxx --sizes "${SIZES:-2M,64M,256M,1G,4G}" \
    --repeats "${REPEATS:-5}" --links "${LINKS:-}" --json "$OUT/peers_h100.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/peers_h100.md" | tail -40
