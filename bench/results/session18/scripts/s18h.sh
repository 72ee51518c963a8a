. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kvferry/data bench/.prof/s17_root/kvferry/
for tree in new old new; do
  if [ $tree = old ]; then dir=bench/.prof/s17_root; else dir=.; fi
  (cd $dir && PYTHONPATH=/tmp/site:$PWD python3 bench/entropy_profile.py --repeats 9 --json $OUT/profile_$tree.json 2>&1 | grep -E "^\|" | sed "s/^/$tree /")
done
timeout 330 python3 bench/peers.py --backend ucxx --sizes 2M,256M,1G --links 12.5,25,50 --codecs raw,splitzip,auto --repeats 5 --json $OUT/peers_std.json 2>&1 | grep -E "^\|" | grep -v receiver
