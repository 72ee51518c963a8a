#!/usr/bin/env bash
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transport/test_checksum.py 2>&1 | tail -2
timeout 60 python3 bench/.prof/crc_bench.py 2>&1 | tail -8
bash bench/.prof/tl.sh
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 1G --repeats 8 --links 12.5,25,50 --codecs splitzip --link-min-bytes 1G --json "$OUT/peers_links.json" 2>&1 | tee "$OUT/peers_links.md" | tail -9
