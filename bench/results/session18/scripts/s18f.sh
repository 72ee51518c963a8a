. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
for mode in taper plain; do
  if [ $mode = plain ]; then export PYTHONPATH=$PWD/bench/.prof/notaper:/tmp/site:$PWD; else export PYTHONPATH=/tmp/site:$PWD; fi
  timeout 150 python3 bench/e2e.py --tokens 8K --links 25 --codecs splitzip,entropy,auto --repeats 7 --out $OUT/e2e_${mode}_$round.json --plot $OUT/e2e.png 2>&1 | grep -E "^\| 25" | sed "s/^/$mode $round /"
done
done
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/e2e_*.json")):
    pts = {p["codec"]: p for p in json.load(open(f))["points"]}
    s = pts["splitzip"]["median_s"]
    print(os.path.basename(f), " ".join(f"{c} {p['median_s']*1e3:.2f} ms ({s/p['median_s']:.3f}x)" for c, p in pts.items()))
PY
