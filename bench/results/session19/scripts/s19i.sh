. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do for mib in 64 128 256; do
  KVFERRY_CHUNK_BYTES=$((mib<<20)) timeout 150 python3 bench/peers.py --backend ucxx --sizes 1G --links 25 --link-min-bytes 1G --codecs splitzip,entropy --repeats 5 --no-nixl 2>&1 | grep "GB/s |" | grep -v receiver | grep -v unpaced | sed "s/^/$round ${mib}MiB /"
done; done
