. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q -x tests/codec/test_entropy_gpu.py tests/codec/test_pending.py tests/engine/test_inline.py tests/engine/test_gpu_transfers.py 2>&1 | tail -3
python3 bench/.prof/s18a.py 2>&1 | tail -4
python3 bench/peers.py --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs splitzip,entropy,auto --no-nixl --json $OUT/peers_axes.json 2>&1 | grep -v "^\s*$" | tail -14
python3 bench/peers.py --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs entropy,auto --no-nixl --no-axes --json $OUT/peers_noaxes.json 2>&1 | grep -v "^\s*$" | tail -8
timeout 200 python3 bench/e2e.py --tokens 8K --links 25 --codecs splitzip,auto --repeats 5 --out $OUT/e2e.json --plot $OUT/e2e.png 2>&1 | tail -25
