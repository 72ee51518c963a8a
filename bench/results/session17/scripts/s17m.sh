. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
python3 bench/.prof/ev2_check.py 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codec/test_pending.py tests/codec/test_entropy_gpu.py tests/codec/test_entropy_huffman.py tests/codec/test_gpu.py 2>&1 | tail -2
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py tests/engine/test_pipeline.py 2>&1 | tail -2
timeout 150 python3 bench/entropy_profile.py --repeats 9 --json $OUT/final.json > $OUT/final.log 2>&1; grep -E "^entropy" $OUT/final.log | cut -c1-200
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs entropy,splitzip,auto --link-min-bytes 1G --no-nixl --json $OUT/peers.json 2>&1 | grep -v "NIXL INFO" | tail -12
python3 -c "
import json; d = json.load(open('$OUT/peers.json'))
for r in d['rows']:
    if r.get('choice_reason') and 'auto' in r['how']: print(r['how'], '|', r['choice_reason'])
"
cd $OUT && tar czf r.tgz *.json *.log; ls
