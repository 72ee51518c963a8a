#!/usr/bin/env bash
# One device call: kvferry's pipeline chunk size (KVFERRY_CHUNK_BYTES) against emulated links, where
# the first chunk's encode and the last one's decode are not hidden behind the link.
# Carry .whl-svc and .whl-ucx (bench/make_device_bundles.sh). Usage there: bash bench/chunk_links.sh
#   (CHUNKS="268435456 134217728 67108864", LINKS=25,50, SIZES=1G,4G, CODECS=raw,splitzip, REPEATS=5)
set -uo pipefail
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
for chunk in ${CHUNKS:-268435456 134217728 67108864}; do
  echo "=== KVFERRY_CHUNK_BYTES=$chunk"
  KVFERRY_CHUNK_BYTES=$chunk timeout 200 python3 bench/peers.py --device cuda --backend ucxx \
      --codecs "${CODECS:-raw,splitzip}" --sizes "${SIZES:-1G,4G}" --repeats "${REPEATS:-5}" --links "${LINKS:-25,50}" \
      --link-min-bytes 1G --no-nixl --json "$OUT/chunk_links_$chunk.json" 2>&1 | grep "^|" | grep " GB/s |" \
      | grep -v "at the receiver"
done
