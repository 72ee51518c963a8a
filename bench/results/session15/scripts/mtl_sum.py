"""Summarise mtl_*.json: per message (windows from the sender's conn.send> to conn.send<), the median
offset of each event (nth occurrence of its name within the window), both processes."""
import json, statistics, sys, glob, collections
files = sys.argv[1:]
ev = {f: json.load(open(f)) for f in files}
sender = [f for f in files if "send" in f][0]
starts = [t for t, n in ev[sender] if n == "conn.send>"]
ends = [t for t, n in ev[sender] if n == "conn.send<"]
off = collections.defaultdict(list)
for s, e in list(zip(starts, ends))[5:]:
    for f in files:
        role = "S" if f == sender else "R"
        seen = collections.Counter()
        for t, n in ev[f]:
            if s <= t <= e:
                seen[n] += 1
                off[(role, n, seen[n])].append((t - s) * 1e3)
rows = sorted(((statistics.median(v), k, len(v)) for k, v in off.items()))
for m, (role, n, i), c in rows:
    print(f"{m:8.3f} ms  {role} {n} #{i}  (n={c})")
