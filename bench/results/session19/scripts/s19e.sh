. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kvferry/data bench/.prof/s18_root/kvferry/
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/codec/test_entropy_gpu.py tests/codec/test_pending.py tests/engine/test_inline.py 2>&1 | tail -2
for tree in new old; do
  if [ $tree = old ]; then dir=bench/.prof/s18_root; else dir=.; fi
  (cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 $OLDPWD/bench/.prof/s19d.py 25 entropy 8 2>&1 | grep -E "^25" | cut -c1-90 | sed "s/^/$tree /")
done
