. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
  timeout 170 python3 bench/e2e.py --tokens 8K --links 25 --codecs splitzip,entropy,auto --repeats 7 --out $OUT/e2e_$round.json 2>&1 | grep -E "^\| 25" | sed "s/^/e2e $round /"
done
timeout 330 python3 bench/peers.py --backend ucxx --sizes 2M,256M,1G --links 12.5,25,50 --codecs raw,splitzip,auto --repeats 5 --json $OUT/peers_std.json 2>&1 | grep -E "^\|" | grep -v receiver
python3 -c "
import json; rows=json.load(open('$OUT/peers_std.json'))['rows']
[print(r['how'], r.get('link_gbps'), r.get('choice_reason','')[:150]) for r in rows if 'choice_reason' in r and r.get('link_gbps')]"
