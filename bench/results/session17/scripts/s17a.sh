. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python3 bench/.prof/ev2_check.py > $OUT/check.log 2>&1; tail -25 $OUT/check.log
timeout 200 python3 -m pytest -q -x tests/codec/test_entropy_gpu.py -p no:cacheprovider > $OUT/tests.log 2>&1; tail -15 $OUT/tests.log
timeout 150 python3 bench/entropy_profile.py --repeats 5 --json $OUT/new.json > $OUT/new.log 2>&1; tail -30 $OUT/new.log
cp -r kvferry/data bench/.prof/v1_root/kvferry/
(cd bench/.prof/v1_root && timeout 150 python3 bench/entropy_profile.py --repeats 5 --json $OUT/old.json > $OUT/old.log 2>&1); tail -30 $OUT/old.log
cd $OUT && tar czf r.tgz *.log *.json gpu.txt 2>/dev/null; ls
