"""One encode and one decode of 64M BF16 elements of real KV (tiled), for Nsight Compute."""
import sys
import torch
sys.path.insert(0, '.')
from kvferry.codec import entropy
from kvferry.codec.bench import tile
sys.path.insert(0, 'bench')
from entropy_gpu import real_kv
kv = real_kv()
book = entropy.calibrate(kv["c0"].to(torch.bfloat16), token_axis=3)
x = tile(kv["c1"].reshape(-1), 64 << 20).to(torch.bfloat16).cuda()
f = entropy.encode(x, book, checksum=False)
y = torch.empty_like(x)
entropy.decode(f, out=y)
torch.cuda.synchronize()
print("ok", torch.equal(x.view(torch.int16), y.view(torch.int16)), f.numel())
