. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q tests/codec/test_entropy_gpu.py tests/codec/test_pending.py tests/engine/test_inline.py tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py 2>&1 | grep -E "^FAILED|^E  |passed|failed" | head -20

python3 bench/peers.py --backend ucxx --sizes 1G --repeats 7 --links 25 --codecs splitzip,entropy,auto --no-nixl --json $OUT/peers_axes.json 2>&1 | grep -E "25 GB/s" | grep -v receiver
timeout 150 python3 bench/e2e.py --tokens 8K --links 25 --codecs splitzip,entropy,auto --repeats 7 --out $OUT/e2e.json --plot $OUT/e2e.png 2>&1 | grep -E "^\| 25|Codec at"
python3 -c "
import json
for p in json.load(open('$OUT/e2e.json'))['points']:
    if p['codec'] == 'auto': print('e2e', p['reason'])
for r in json.load(open('$OUT/peers_axes.json'))['rows'] if isinstance(json.load(open('$OUT/peers_axes.json')), dict) else json.load(open('$OUT/peers_axes.json')):
    if r.get('choice_reason','').startswith(('predicted','measured')): print('peers', r['choice_reason'])
"
