"""Session 18: entropy kernels with a block-period codebook (layout learned) vs a channel one."""
import sys, time, statistics, torch
from pathlib import Path
ROOT = Path.cwd(); sys.path.insert(0, str(ROOT))
from kvferry.demo import llama_blocks, LLAMA_AXES
from kvferry import codec
dev = "cuda"
b = llama_blocks(ROOT / "kvferry/data/kv_smollm2_gpl3.npz", 256, device=dev)  # 512 MiB
lay = codec.BlockLayout(tuple(b.shape[1:]), LLAMA_AXES)
e = codec.get("entropy")
ids = torch.randperm(256, device=dev)[:128]
out = torch.zeros_like(b)
from kvferry.codec.entropy import gpu
for name, layout, compact in (("channels", None, 1 << 15), ("layout, a word per position", lay, 1 << 40),
                              ("layout, a word per context", lay, 1 << 15)):
    gpu.COMPACT_FROM = compact
    torch.cuda.synchronize(); t = time.perf_counter()
    book = e.learn(b[:32], layout)
    from kvferry.codec.entropy.huffman import code_tables
    p4 = gpu._tables_on(code_tables(book), torch.device(dev)).p4
    torch.cuda.synchronize(); learn_s = time.perf_counter() - t
    f = e.encode_blocks(b, ids, book)
    # CPU == GPU bytes on two blocks
    small = e.encode_blocks(b, ids[:2], book)
    cpu = e.encode_blocks(b.cpu(), ids[:2].cpu(), book)
    same = torch.equal(small.cpu(), cpu)
    e.decode_blocks(f, out, ids)
    exact = torch.equal(out[ids].view(torch.int16), b[ids].view(torch.int16))
    enc, dec = [], []
    for _ in range(9):
        torch.cuda.synchronize(); t = time.perf_counter(); f = e.encode_blocks(b, ids, book); torch.cuda.synchronize(); enc.append(time.perf_counter() - t)
        torch.cuda.synchronize(); t = time.perf_counter(); e.decode_blocks(f, out, ids); torch.cuda.synchronize(); dec.append(time.perf_counter() - t)
    nbytes = ids.numel() * b[0].numel() * 2
    print(f"{name} {p4}: learn {learn_s*1e3:.1f} ms (32 blocks), ratio {nbytes / f.numel():.4f}, GPU==CPU {same}, exact {exact}, "
          f"encode {nbytes/statistics.median(enc)/1e9:.1f} GB/s, decode {nbytes/statistics.median(dec)/1e9:.1f} GB/s (256 MiB blocks)", flush=True)
