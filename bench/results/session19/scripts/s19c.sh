. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kvferry/data bench/.prof/s18_root/kvferry/
# 1. GPU tests of what changed (block copies, same-host writes, leases) and the engine's CPU tests of it.
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/codec/test_blockcopy.py tests/engine/test_gpu_transfers.py tests/engine/test_leases.py tests/engine/test_blocks.py tests/engine/test_policy.py tests/engine/test_inline.py 2>&1 | tail -3
# 2. One-block latency, the session-18 tree against this one, twice.
for round in 1 2; do for tree in old new; do
  if [ $tree = old ]; then dir=bench/.prof/s18_root; else dir=.; fi
  for backend in tcp ucxx; do
    (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/latency.py --device cuda --backend $backend --block-kib 2048 --n 2000 --long 0 --cpu-threads 0 > $OUT/lat_${tree}_${backend}_$round.log 2>&1)
    echo "$round $tree $backend $(grep -A1 '^run' $OUT/lat_${tree}_${backend}_$round.log | tail -1) | $(grep stages $OUT/lat_${tree}_${backend}_$round.log)"
  done
done; done
# 3. auto on links with this session's policy.
timeout 200 python3 bench/peers.py --backend ucxx --sizes 1G --links 25,50 --codecs splitzip,auto --repeats 8 --no-nixl --json $OUT/peers_new.json 2>&1 | grep -E "^\|" | grep -v receiver | grep GB/s
python3 -c "
import json; rows=json.load(open('$OUT/peers_new.json'))['rows']
[print(r['how'], r.get('link_gbps'), r.get('choice_reason','')[:200]) for r in rows if 'choice_reason' in r]"
# 4. The connector harness.
for codec in raw auto; do timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec $codec --layout in-place --json $OUT/harness_$codec.json 2>&1 | tail -4; done
