. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
# 1. Where a one-block GPU transfer's time goes: py-spy on both sidecars mid-run.
python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 30000 --long 0 --cpu-threads 0 > $OUT/lat_tcp_spy.log 2>&1 &
LAT=$!
sleep 35
ps -eo pid,args | grep "kvferry.cli serve" | grep -v grep > $OUT/sidecars.txt
for p in $(pgrep -f "kvferry.cli serve"); do
  bench/.prof/py-spy record -p $p -d 6 -r 1000 -f raw --nonblocking -o $OUT/spy_$p.txt > $OUT/spyerr_$p.txt 2>&1 &
done
sleep 8
wait $LAT
tail -4 $OUT/lat_tcp_spy.log
# 2. auto with and without trying close codecs (new tree vs the session-18 tree), 1 GiB on 25 and 50 GB/s.
cp -r kvferry/data bench/.prof/s18_root/kvferry/
for tree in new old new old; do
  if [ $tree = old ]; then dir=bench/.prof/s18_root; else dir=.; fi
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/peers.py --backend ucxx --sizes 1G --links 25,50 --codecs splitzip,auto --repeats 8 --no-nixl --json $OUT/peers_$tree.json 2>&1 | grep -E "^\|" | grep -v receiver | grep GB/s | sed "s/^/$tree /")
  python3 -c "
import json,sys; rows=json.load(open('$OUT/peers_$tree.json'))['rows']
[print('$tree', r['how'], r.get('link_gbps'), r.get('choice_reason','')[:160]) for r in rows if 'choice_reason' in r]" 2>&1 | tail -3
done
