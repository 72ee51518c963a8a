. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/.prof/ev2_check.py 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codec/test_entropy_gpu.py tests/codec/test_entropy_huffman.py tests/codec/test_entropy_roundtrip.py 2>&1 | tail -2
for r in 1 2; do timeout 150 python3 bench/entropy_profile.py --repeats 9 --json $OUT/final$r.json > $OUT/final$r.log 2>&1; grep -E "^entropy|^device" $OUT/final$r.log | cut -c1-300; done
cd $OUT && tar czf r.tgz *.log *.json
