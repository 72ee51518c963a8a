. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
python3 bench/.prof/ev2_check.py 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/codec/test_pending.py tests/codec/test_entropy_gpu.py tests/codec/test_entropy_huffman.py 2>&1 | tail -2
python3 - <<'PY'
import sys, time, torch
sys.path.insert(0, '.')
from kvferry import codec
c = codec.get("entropy")
x = (torch.randn(8 << 20) * 0.05).to(torch.bfloat16).reshape(-1, 16, 8, 128).cuda()
c.learn(x[:64]); torch.cuda.synchronize()
for where, t in (("gpu", x), ("cpu", x.cpu())):
    s = time.perf_counter(); c.learn(t); print(f"learn 16 MiB on the {where}: {(time.perf_counter() - s) * 1e3:.1f} ms")
PY
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 5 --links 25 --codecs splitzip,entropy,auto --link-min-bytes 1G --no-nixl --json $OUT/peers.json 2>&1 | grep -v "NIXL INFO" | tee $OUT/peers.md | tail -14
cd $OUT && tar czf r.tgz *.md *.json 2>/dev/null; ls
