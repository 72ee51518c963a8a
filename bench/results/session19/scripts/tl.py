"""Summarise /tmp/kvtl/*.tl: for each sender process, its last N transfers (from 'submit+' to the
next), every event of it and of the overlapping receiver, in ms from the submit."""
import glob, sys
procs = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.tl")):
    rows = []
    for line in open(f):
        p = line.split()
        if len(p) >= 3:
            rows.append((int(p[0]), p[1], p[2], " ".join(p[3:])))
    if rows:
        procs[f] = rows
last = int(sys.argv[2]) if len(sys.argv) > 2 else 2
for sender, rows in procs.items():
    subs = [e[0] for e in rows if e[2] == "submit+"]
    if not subs:
        continue
    lo, hi = rows[0][0], rows[-1][0]
    others = [f for f, r in procs.items() if f != sender and r[0][0] < hi and r[-1][0] > lo
              and not any(e[2] == "submit+" for e in r)]
    allev = sorted([(e[0], "S", *e[1:]) for e in rows] + [(e[0], "R", *e[1:]) for f in others for e in procs[f]])
    print(f"===== sender {sender} receivers {others}")
    for k in range(max(0, len(subs) - last), len(subs)):
        t0, end = subs[k], subs[k + 1] if k + 1 < len(subs) else 1 << 62
        print(f"--- transfer {k}")
        for ts, side, th, name, extra in allev:
            if t0 <= ts < end:
                print(f"{(ts - t0) / 1e3:9.3f} {side} {th:>4} {name:12} {extra}")
