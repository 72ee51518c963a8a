. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
timeout 250 python3 bench/peers.py --backend ucxx --sizes 2M,256M --codecs raw,auto --repeats 5 --json $OUT/peers_1b_$round.json 2>&1 | grep -E "^\| (kvferry|nixl)" | sed "s/^/$round /"
done
