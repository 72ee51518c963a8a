. bench/device_setup.sh
python3 bench/.prof/ev2_check.py 2>&1 | tail -2
for r in 1 2; do timeout 120 python3 bench/entropy_profile.py --repeats 9 --blocks 0 > $OUT/new$r.log 2>&1; grep -E "^entropy" $OUT/new$r.log | cut -c1-240; done
cd $OUT && tar czf r.tgz *.log
