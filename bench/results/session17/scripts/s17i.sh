. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
python3 bench/.prof/ev2_check.py 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codec/test_pending.py tests/codec/test_entropy_gpu.py tests/codec/test_entropy_huffman.py 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_pipeline.py 2>&1 | tail -3
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs splitzip,entropy,auto --link-min-bytes 1G --no-nixl --json $OUT/peers.json 2>&1 | grep -v "NIXL INFO" | tee $OUT/peers.md | tail -14
cd $OUT && tar czf r.tgz *.md *.json 2>/dev/null; ls
