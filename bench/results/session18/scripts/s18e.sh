. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -q tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py tests/engine/test_peers.py -k "not cpu" 2>&1 | grep -E "^FAILED|^E  |passed|failed" | head -10
timeout 200 python3 bench/e2e.py --tokens 8K --links 25,max --codecs splitzip,entropy,auto --repeats 7 --out $OUT/e2e.json --plot $OUT/e2e.png 2>&1 | grep -E "^\| (25|max)|Codec at"
python3 bench/peers.py --backend ucxx --sizes 1G --repeats 7 --links 25 --codecs splitzip,entropy,auto --no-nixl --json $OUT/peers_axes.json 2>&1 | grep -E "GB/s \||unpaced" | grep -v receiver
python3 -c "
import json
for p in json.load(open('$OUT/e2e.json'))['points']:
    if p['codec'] == 'auto': print('e2e', p['link'], p['reason'])
"
