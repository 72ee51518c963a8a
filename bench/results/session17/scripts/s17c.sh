. bench/device_setup.sh
for r in 1 2; do timeout 120 python3 bench/entropy_profile.py --repeats 9 --blocks 0 > $OUT/new$r.log 2>&1; grep -E "^entropy|^device" $OUT/new$r.log | cut -c1-140; done
timeout 120 python3 bench/entropy_profile.py --repeats 5 --blocks 0 --host-profile > $OUT/hp.log 2>&1; grep -A 30 "host profile" $OUT/hp.log | head -80
cd $OUT && tar czf r.tgz *.log
