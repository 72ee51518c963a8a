"""Entropy v2 on the GPU against the CPU reference: per case, bytes equal (first differing
stream and chunk otherwise), round trip, and a corrupted frame raising."""
import sys, traceback
import numpy as np, torch
sys.path.insert(0, '.')
from kvferry.codec import entropy
from kvferry.codec.entropy.codec import encode_reference
from kvferry.codec.entropy.format import Stream
from tests.codec.test_entropy_roundtrip import kv_like, with_specials

def where(h, off):
    for i, (o, n) in enumerate(zip(h.offsets, h.lengths)):
        if o <= off < o + n:
            return f"stream {i} +{off - o}"
    return "header/padding"

cases = []
for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
    book = entropy.calibrate(kv_like((4, 256, 32), dtype, seed=1), token_axis=1, tables=8)
    cases += [(dtype, (4, 512, 32), 2048, book, True), (dtype, (3, 300, 32), 32768, book, False),
              (dtype, (4, 17, 32), 64, book, False), (dtype, (8, 256, 32), 4096, book, True)]
bad = 0
for dtype, shape, chunk, book, specials in cases:
    x = kv_like(shape, dtype, seed=2)
    if specials:
        x = with_specials(x, seed=3)
    try:
        cpu = encode_reference(x, book, checksum=False, chunk=chunk)
        gpu = entropy.encode(x.cuda(), book, checksum=False, chunk=chunk).cpu()
        same = cpu.numel() == gpu.numel() and torch.equal(cpu, gpu)
        msg = ""
        if not same:
            n = min(cpu.numel(), gpu.numel())
            d = (cpu[:n] != gpu[:n]).nonzero()
            first = int(d[0]) if d.numel() else n
            h = entropy.read_header(cpu) if cpu[6].item() == 2 else None
            msg = f"sizes {cpu.numel()} {gpu.numel()} first diff {first} ({where(h, first) if h else '-'})"
        y = entropy.decode(cpu.cuda())
        rt = torch.equal(y.cpu().view(torch.uint8), x.view(torch.uint8))
        print(f"{str(dtype):22} {str(shape):16} chunk {chunk:6} codec {cpu[6].item()} equal {same} roundtrip {rt} {msg}", flush=True)
        bad += (not same) + (not rt)
    except Exception:
        traceback.print_exc()
        bad += 1
print("BAD", bad)
