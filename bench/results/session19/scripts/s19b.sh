. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
# 1. Where a one-block GPU transfer's time goes: py-spy on both sidecars once they are ready.
python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 8000 --long 0 --cpu-threads 0 > $OUT/lat_tcp_spy.log 2>&1 &
LAT=$!
for i in $(seq 1 240); do
  ports=$(ps -eo args | grep "kvferry.cli serve" | grep -v grep | sed -E 's/.* --port ([0-9]+) .*/\1/')
  n=0; for port in $ports; do curl -s http://127.0.0.1:$port/v1/health | grep -q '"ready"' && n=$((n+1)); done
  [ "$n" = 2 ] && break; sleep 0.5
done
echo "ready after $i polls"; sleep 3
ps -eo pid,args | grep "kvferry.cli serve" | grep -v grep | cut -c1-160 > $OUT/sidecars.txt
for p in $(pgrep -f "kvferry.cli serve"); do
  bench/.prof/py-spy record -p $p -d 5 -r 1000 -f raw --nonblocking -o $OUT/spy_$p.txt > $OUT/spyerr_$p.txt 2>&1 &
done
wait $LAT
grep -A3 "^run" $OUT/lat_tcp_spy.log; tail -2 $OUT/lat_tcp_spy.log
python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 2000 --long 0 --cpu-threads 0 2>&1 | grep -A3 "^run"
# 2. auto, new tree vs the session-18 tree, 1 GiB on 25 and 50 GB/s.
cp -r kvferry/data bench/.prof/s18_root/kvferry/
for tree in new old new old; do
  if [ $tree = old ]; then dir=bench/.prof/s18_root; else dir=.; fi
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/peers.py --backend ucxx --sizes 1G --links 25,50 --codecs splitzip,auto --repeats 8 --no-nixl --json $OUT/peers_$tree.json 2>&1 | grep -E "^\|" | grep -v receiver | grep GB/s | sed "s/^/$tree /")
  python3 -c "
import json,sys; rows=json.load(open('$OUT/peers_$tree.json'))['rows']
[print('$tree', r['how'], r.get('link_gbps'), r.get('choice_reason','')[:160]) for r in rows if 'choice_reason' in r]" 2>&1 | tail -3
done
# 3. The connector harness (issue 16's overhead), raw and auto.
for codec in raw auto; do timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec $codec --layout in-place --json $OUT/harness_$codec.json 2>&1 | tail -4; done
