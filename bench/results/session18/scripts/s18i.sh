. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in r600 r30 r600 r30; do
  if [ $mode = r30 ]; then export PYTHONPATH=$PWD/bench/.prof/relearn30:/tmp/site:$PWD; else export PYTHONPATH=/tmp/site:$PWD; fi
  python3 bench/peers.py --backend ucxx --sizes 1G --repeats 15 --links 12.5,25,50 --codecs splitzip,auto --no-nixl --json $OUT/peers_$mode.json 2>&1 | grep -E "GB/s \|" | grep -v receiver | sed "s/^/$mode /"
done
