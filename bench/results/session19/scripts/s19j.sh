. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kvferry/data bench/.prof/s18_root/kvferry/ 2>/dev/null
# One block in peers.py (ucxx) with py-spy on both sidecars, and stages; then latency.py ucxx for comparison.
timeout 200 python3 bench/peers.py --backend ucxx --sizes 2M --codecs raw --repeats 6000 --no-nixl --json $OUT/peers_1b.json > $OUT/peers_1b.log 2>&1 &
P=$!
for i in $(seq 1 240); do
  ports=$(ps -eo args | grep "kvferry.cli serve" | grep -v grep | sed -E 's/.* --port ([0-9]+) .*/\1/')
  n=0; for port in $ports; do curl -s http://127.0.0.1:$port/v1/health | grep -q '"ready"' && n=$((n+1)); done
  [ "$n" = 2 ] && break; sleep 0.5
done
sleep 4
ps -eo pid,args | grep "kvferry.cli serve" | grep -v grep | cut -c1-120 > $OUT/sidecars.txt
for p in $(pgrep -f "kvferry.cli serve"); do
  bench/.prof/py-spy record -p $p -d 4 -r 1000 -f raw --nonblocking -o $OUT/spy_$p.txt > /dev/null 2>&1 &
done
wait $P
grep "GB/s |" $OUT/peers_1b.log | grep -v unpaced -v 2>/dev/null; grep "2 MiB" $OUT/peers_1b.log
python3 -c "
import json; rows=json.load(open('$OUT/peers_1b.json'))['rows']
[print(r['how'], r.get('median_s'), r.get('stages_median_ms')) for r in rows]"
timeout 120 python3 bench/latency.py --device cuda --backend ucxx --block-kib 2048 --n 2000 --long 0 --cpu-threads 0 2>&1 | grep -A2 "^run\|stages"
