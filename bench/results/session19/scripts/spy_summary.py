import sys, collections
incl = collections.Counter(); self_ = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(' ')
    n = int(n); total += n
    frames = stack.split(';')
    seen = set()
    for f in frames:
        key = f.split(' (')[0] + ' ' + (f.split('(')[1].split(':')[0].split('/')[-1] if '(' in f else '')
        if key not in seen:
            incl[key] += n; seen.add(key)
    f = frames[-1]; self_[f.split(' (')[0] + ' ' + (f.split('(')[1].split('/')[-1] if '(' in f else '')] += n
print('total', total)
print('--- inclusive'); [print(f'{v/total*100:5.1f} {k}') for k, v in incl.most_common(int(sys.argv[2]))]
print('--- self'); [print(f'{v/total*100:5.1f} {k}') for k, v in self_.most_common(25)]
