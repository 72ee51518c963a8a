#!/usr/bin/env bash
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 bench/.prof/msg_cost.py --backend ucxx 2>&1 | grep "ms,"
timeout 120 python3 bench/.prof/msg_cost.py --backend ucxx --fresh 2>&1 | grep "ms,"
