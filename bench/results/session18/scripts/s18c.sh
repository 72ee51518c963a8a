. bench/device_setup.sh
python3 -m pytest -q -x tests/codec/test_entropy_gpu.py -k word_per_context 2>&1 | grep -E "Error|error|assert|^E " | head -20
for c in 256 64; do
timeout 150 python3 bench/e2e.py --tokens 8K --links 25 --codecs splitzip,entropy,auto --repeats 5 --chunk-mib $c --out $OUT/e2e_$c.json --plot $OUT/e2e_$c.png 2>&1 | grep -E "^\| 25|Codec at"
done
python3 -c "
import json
for c in (256, 64):
    for p in json.load(open('$OUT/e2e_%d.json' % c))['points']:
        if p['codec'] == 'auto': print(c, p['reason'])
"
