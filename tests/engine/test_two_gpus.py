"""Two GPUs of one host, one sidecar each: every transfer path from GPU 0 to GPU 1 and back, bit
exact, the blocks not named untouched. The same-host write under a lease (raw and ``auto``; the
sender opens the receiver's CUDA IPC handle in its own GPU's context and writes over NVLink/P2P),
and streamed with every lossless codec over ucxx (CUDA IPC between the GPUs) and over TCP (an
emulated link too fast to pace, which takes no same-host shortcut). Block lists spread (a vLLM
block across a cache's planes) and packed. A receiver whose lent handle lies about its offset or
size fails one transfer, before any write, and the sender's GPU keeps working. Skipped with fewer
than two GPUs or without CuPy."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid

import pytest
import torch

from kvferry.client import packed
from kvferry.client.memory import cuda_ipc_handle
from kvferry.engine import Blocks, Engine, RegionSpec, Settings, TransferSpec, ipc, peer
from kvferry.engine.errors import TransferFailed
from kvferry.engine.leases import Held
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ipc.available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs and CuPy")]

BLOCKS, PLANES = 64, 4  # a spread id i stands for i, i + 16, i + 32, i + 48
CODECS = ["raw", "splitzip", "entropy", "auto"]
LISTS = {
    "spread": ({"ids": [0, 3, 5, 9, 12], "count": PLANES, "stride": BLOCKS // PLANES},
               {"ids": [15, 2, 7, 11, 4], "count": PLANES, "stride": BLOCKS // PLANES}),
    "packed": (packed([(7 * i) % BLOCKS for i in range(40)]), packed([(11 * i + 5) % BLOCKS for i in range(40)])),
}
PATHS = {  # sidecar backend, environment
    "lease": ("tcp", {}),
    "ucxx": ("ucxx", {"UCX_TLS": "tcp,cuda_copy,cuda_ipc", "KVFERRY_EMULATED_LINK_GBPS": "100000"}),
    "tcp": ("tcp", {"KVFERRY_EMULATED_LINK_GBPS": "100000"}),
}


def _ids(blocks: dict | list[int]) -> list[int]:
    if "count" in blocks:
        return [i + j * blocks["stride"] for i in blocks["ids"] for j in range(blocks["count"])]
    import base64

    return torch.frombuffer(bytearray(base64.b64decode(blocks["packed"])), dtype=torch.int32).tolist()


class Side:
    """One GPU's sidecar and the two caches this process lends it (source and destination)."""

    def __init__(self, daemon, gpu: int, kv: torch.Tensor):
        self.daemon, self.gpu = daemon, gpu
        source = torch.cat([kv, kv[:BLOCKS - len(kv)]]) if len(kv) < BLOCKS else kv[:BLOCKS]
        self.src = source.to(f"cuda:{gpu}").contiguous()
        self.dst = torch.empty_like(self.src)
        daemon.client.region_from_tensor("src", self.src, kind="cuda_ipc")
        daemon.client.region_from_tensor("dst", self.dst, kind="cuda_ipc")


@pytest.fixture(scope="module", params=list(PATHS))
def gpus(request, kv):
    backend, env = PATHS[request.param]
    env = {"KVFERRY_CHUNK_BYTES": str(4 << 20), "KVFERRY_TRANSFER_TIMEOUT": "60", **env}
    daemons = [spawn(backend, env, device=f"cuda:{gpu}") for gpu in (0, 1)]
    try:
        yield request.param, [Side(d, gpu, kv) for gpu, d in enumerate(daemons)]
    finally:
        stop(*daemons)


@pytest.mark.parametrize("lists", list(LISTS))
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("direction", [(0, 1), (1, 0)], ids=["gpu0-to-gpu1", "gpu1-to-gpu0"])
def test_every_path_and_codec_is_bit_exact_between_the_gpus(gpus, direction, codec, lists):
    path, sides = gpus
    sender, receiver = sides[direction[0]], sides[direction[1]]
    src_blocks, dst_blocks = LISTS[lists]
    src_ids, dst_ids = _ids(src_blocks), _ids(dst_blocks)
    receiver.dst.view(torch.int16).random_(-32768, 32767)  # not zeros: untouched blocks must keep these bits
    before = receiver.dst.clone()
    torch.cuda.synchronize(receiver.gpu)
    result = sender.daemon.client.wait(sender.daemon.client.submit(
        "src", src_blocks, receiver.daemon.data, "dst", dst_blocks, codec=codec), timeout=120)
    assert result["state"] == "done", result
    same_host = "same host" in result["choice_reason"]
    assert same_host == (path == "lease" and codec in ("raw", "auto")), result
    if codec != "auto":
        assert result["chosen_codec"] == codec, result
    torch.cuda.synchronize(receiver.gpu)
    assert bits_equal(receiver.dst[dst_ids].cpu(), sender.src[src_ids].cpu())
    others = sorted(set(range(BLOCKS)) - set(dst_ids))
    assert bits_equal(receiver.dst[others].cpu(), before[others].cpu())


def test_a_lent_handle_that_lies_fails_one_transfer_and_the_next_works(kv):
    """This process's engine sends from GPU 0 to a sidecar on GPU 1, which lends its own GPU
    memory; once it holds the lease, the lease is forged to lie (an offset past the allocation, a
    block count past it): each such transfer fails before any write, the sender's GPU context
    stays usable, and an honest transfer after each lands bit-exact."""
    from kvferry.demo import _PEER_SECRET

    receiver = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "60"}, device="cuda:1")
    shape = tuple(kv.shape[1:])
    try:
        receiver.client.create_region("d", BLOCKS, list(shape), "bfloat16")

        async def main():
            a = Engine(Settings(data_port=0, device="cuda:0", transport_backend="tcp", transfer_timeout=30,
                                peer_secret=_PEER_SECRET))
            await a.start()
            try:
                src = await a.register_region(RegionSpec("s", BLOCKS, shape, "bfloat16"))
                src.tensor.copy_(torch.cat([kv, kv[:BLOCKS - len(kv)]]) if len(kv) < BLOCKS else kv[:BLOCKS])

                async def send(src_ids: list[int], dst_ids: list[int]) -> dict:
                    spec = TransferSpec(peer=receiver.data, pairs=(("s", "d"),), src_blocks=Blocks.of(src_ids),
                                        dst_blocks=Blocks.of(dst_ids), codec="raw")
                    return await a.wait(a.submit(spec).id, 60)

                async def honest(src_ids: list[int], dst_ids: list[int]) -> None:
                    record = await send(src_ids, dst_ids)
                    assert record["state"] == "done" and "same host" in record["choice_reason"], record
                    landed = torch.stack([torch.frombuffer(bytearray(receiver.client.get_block("d", i)),
                                                           dtype=torch.bfloat16).view(shape) for i in dst_ids])
                    assert bits_equal(landed, src.tensor[src_ids].cpu())

                await honest(list(range(40)), list(range(63, 23, -1)))
                host, port = receiver.data.rsplit(":", 1)
                connection = a.pool.ready(host, int(port))
                held = a.leases.held(connection, ["d"], [shape], "bfloat16")
                assert held is not None
                good = held[0].target
                lies = {"offset": peer.Target(good.handle, good.offset + (1 << 40), good.device_uuid, BLOCKS),
                        "blocks": peer.Target(good.handle, good.offset, good.device_uuid, 1 << 24)}
                for what, lie in lies.items():
                    for src_ids, dst_ids in (([5], [(1 << 24) - 1 if what == "blocks" else 6]),
                                             (list(range(30)), [(1 << 24) - 1 - i if what == "blocks" else i
                                                                for i in range(30)])):
                        a.leases.hold(connection, [Held("d", lie, shape, "bfloat16")])
                        with pytest.raises(TransferFailed, match="reaches past the .*-byte allocation"):
                            await send(src_ids, dst_ids)
                        torch.cuda.synchronize(0)  # the sender's context is alive
                        a.leases.hold(connection, held)
                        await honest([src_ids[0] + 1, 7], [17, 3])
            finally:
                await a.close()

        asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        stop(receiver)


def test_a_junk_event_handle_is_not_opened_and_leaves_the_gpu_working():
    events = ipc.WriteEvents()
    assert events.open(bytes(64), ipc.device_uuid(0), 1) is None
    assert events.open(bytes(range(64)), bytes(16), 0) is None
    assert ipc.event_device(torch.device("cpu")) is None and ipc.event_device(torch.device("cuda", 1)) == 1
    torch.ones(4, device="cuda:0").sum().item()  # the contexts are alive
    torch.ones(4, device="cuda:1").sum().item()


def _gpus_of(pid: int) -> set[str]:
    """UUIDs of the GPUs where process ``pid`` holds a context (``nvidia-smi``)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {gpu.strip() for line in out.splitlines() for p, gpu in [line.split(",")] if int(p) == pid}


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
@pytest.mark.parametrize("hidden", [False, True], ids=["both-gpus-visible", "sender-gpu-hidden-from-receiver"])
def test_large_writes_are_announced_while_they_run(hidden):
    """A write of at least ``ANNOUNCE_AT_LAUNCH_BYTES`` under a lease is announced as soon as it is
    launched, with the event that ends it (the sender's record: announced before its last byte):
    on the event loop (32 MiB) and past the loop's bound (over 1 GiB), bit-exact, nothing else
    touched. The receiver opens the event in its own GPU's context: it needs no context on the
    sender's GPU, and waits on the event even where that GPU is hidden from it
    (``CUDA_VISIBLE_DEVICES``)."""
    from kvferry.engine.outgoing import ANNOUNCE_AT_LAUNCH_BYTES

    shape, blocks = (4096, 1024), 160  # 8 MiB blocks, 1.25 GiB a cache
    env = {"KVFERRY_TRANSFER_TIMEOUT": "60"}
    sender = spawn("tcp", env, device="cuda:0")
    receiver = spawn("tcp", {**env, **({"CUDA_VISIBLE_DEVICES": "1"} if hidden else {})},
                     device="cuda:0" if hidden else "cuda:1")
    src = torch.empty((blocks, *shape), dtype=torch.bfloat16, device="cuda:0")
    dst = torch.empty((blocks, *shape), dtype=torch.bfloat16, device="cuda:1")
    for t in (src, dst):
        t.view(torch.int16).random_(-32768, 32767)  # every bit pattern: NaNs, -0, subnormals
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    try:
        sender.client.region_from_tensor("s", src, kind="cuda_ipc")
        lent = cuda_ipc_handle(dst)
        if hidden:
            lent["device"] = 0  # the receiver's only GPU
        receiver.client.create_region("d", blocks, list(shape), "bfloat16", kind="cuda_ipc", **lent)

        def send(src_ids: list[int], dst_ids: list[int]) -> dict:
            before = dst.clone()
            torch.cuda.synchronize(1)
            record = sender.client.wait(sender.client.submit("s", src_ids, receiver.data, "d", dst_ids, codec="raw"),
                                        timeout=120)
            assert record["state"] == "done" and "same host" in record["choice_reason"], record
            assert bits_equal(dst[dst_ids].cpu(), src[src_ids].cpu())
            others = sorted(set(range(blocks)) - set(dst_ids))
            assert bits_equal(dst[others].cpu(), before[others].cpu())
            incoming = receiver.client.transfer(record["id"])
            assert incoming["state"] == "done" and incoming["blocks_done"] == len(dst_ids), incoming
            return record["stages"]

        send(list(range(4)), [150, 3, 77, 9])  # the first: offered, lent, written, WRITTEN
        assert 4 * 8 << 20 >= ANNOUNCE_AT_LAUNCH_BYTES
        stages = send([10, 11, 12, 13], [20, 140, 21, 5])  # on the loop; announced at launch
        assert stages["announced"] <= stages["last_byte"], stages
        big = list(range(136))  # 1.06 GiB: past the loop's bound, awaited by polling
        stages = send(big, [blocks - 1 - i for i in big])
        assert stages["announced"] <= stages["last_byte"], stages
        stages = send([100, 101, 102, 103], [0, 1, 2, 159])
        assert stages["announced"] <= stages["last_byte"], stages
        assert _gpus_of(receiver.process.pid) == {f"GPU-{uuid.UUID(bytes=ipc.device_uuid(1))}"}  # its own only
    finally:
        stop(sender, receiver)
