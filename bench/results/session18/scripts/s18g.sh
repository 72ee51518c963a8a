. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python3 -m pytest -q -m gpu tests/codec tests/engine tests/client/test_vllm_core_gpu.py tests/transport --deselect tests/transport/test_peer_loss.py -p no:cacheprovider 2>&1 | grep -E "^FAILED|^ERROR|passed|failed" | head -20
