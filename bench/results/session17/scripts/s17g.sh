. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codec/test_entropy_gpu.py tests/codec/test_entropy_huffman.py tests/codec/test_gpu.py 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py 2>&1 | tail -3
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs splitzip,entropy,auto --link-min-bytes 1G --no-nixl --json $OUT/peers.json 2>&1 | grep -v "NIXL INFO" | tee $OUT/peers.md | tail -16
cd $OUT && tar czf r.tgz *.md *.json 2>/dev/null; ls
