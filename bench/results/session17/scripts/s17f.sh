. bench/device_setup.sh
python3 bench/.prof/ev2_check.py 2>&1 | tail -3
timeout 200 python3 -m pytest -q -x tests/codec/test_entropy_gpu.py -p no:cacheprovider 2>&1 | tail -3
for r in 1 2; do timeout 150 python3 bench/entropy_profile.py --repeats 9 > $OUT/new$r.log 2>&1; grep -E "^entropy" $OUT/new$r.log | cut -c1-250; done
cd $OUT && tar czf r.tgz *.log
