"""Two real sidecars speak only over the data connection: no HTTP between them, a peer without the
secret gets nothing written, and one transfer moves many regions with range block lists."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry.client import packed
from kvferry.engine import errors
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = pytest.mark.slow


def _counter(client, name: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(client.metrics())}
    return sum(s.value for s in families[name].samples if s.name.endswith("_total"))


def _http_requests(client) -> float:
    return _counter(client, "kvferry_http_requests")


def _blocks(client, region: str, ids: list[int], like: torch.Tensor) -> torch.Tensor:
    raw = b"".join(client.get_block(region, i) for i in ids)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).view(len(ids), *like.shape[1:])


def test_sidecars_exchange_no_http(pair, kv):
    a, b = pair
    src, dst = f"s{uuid.uuid4().hex[:8]}", f"d{uuid.uuid4().hex[:8]}"
    a.client.region_from_tensor(src, kv[:6])
    b.client.create_region(dst, 6, list(kv.shape[1:]), "bfloat16")
    before = _http_requests(b.client)
    for codec in ("raw", "splitzip"):
        transfer = a.client.submit(src, range(6), b.data, dst, [5, 4, 3, 2, 1, 0], codec=codec)
        assert a.client.wait(transfer, timeout=60)["state"] == "done"
    # The receiver served only our two metrics scrapes (this one counts itself).
    assert _http_requests(b.client) - before == 1
    assert _counter(a.client, "kvferry_spin_seconds") == _counter(b.client, "kvferry_spin_seconds") == 0  # CPU
    assert bits_equal(_blocks(b.client, dst, [5, 4, 3, 2, 1, 0], kv), kv[:6])


def test_spinning_sidecars_count_it_and_stay_exact(kv):
    """With ``spin_ms`` set both loops busy-poll after activity and say so on /metrics (the CPU
    default, above, never spins); the data is unchanged by it."""
    env = {"KVFERRY_SPIN_MS": "40"}
    a, b = spawn("tcp", env), spawn("tcp", env)
    try:
        a.client.region_from_tensor("src", kv[:4])
        b.client.create_region("dst", 4, list(kv.shape[1:]), "bfloat16")
        transfer = a.client.submit("src", range(4), b.data, "dst", [3, 2, 1, 0], codec="raw")
        assert a.client.wait(transfer, timeout=60)["state"] == "done"
        time.sleep(0.2)  # every window has ended: the counters hold whole episodes
        assert _counter(a.client, "kvferry_spin_seconds") > 0.03
        assert _counter(b.client, "kvferry_spin_seconds") > 0.03
        if len(os.sched_getaffinity(0)) < 4:  # too few CPUs to move among: the loops stay put, and say so
            assert _counter(a.client, "kvferry_loop_moves") == _counter(b.client, "kvferry_loop_moves") == 0
        assert bits_equal(_blocks(b.client, "dst", [3, 2, 1, 0], kv[:4]), kv[:4])
    finally:
        stop(a, b)


def test_a_peer_with_the_wrong_secret_is_refused_and_nothing_is_written(kv):
    a = spawn("tcp", {"KVFERRY_PEER_SECRET": "one secret"})
    b = spawn("tcp", {"KVFERRY_PEER_SECRET": "another secret"})
    try:
        a.client.region_from_tensor("src", kv[:2])
        b.client.create_region("dst", 2, list(kv.shape[1:]), "bfloat16")
        transfer = a.client.submit("src", [0, 1], b.data, "dst", [0, 1], codec="raw")
        with pytest.raises(errors.TransferFailed, match="AuthenticationFailed|secret"):
            a.client.wait(transfer, timeout=30)
        assert b.client.transfers() == []  # nothing was even announced
        assert b.client.get_block("dst", 0) == bytes(len(b.client.get_block("dst", 0)))
    finally:
        stop(a, b)


@pytest.mark.parametrize("codec", ["raw", "splitzip"])
def test_one_transfer_moves_every_layer_with_ranges_into_permuted_blocks(pair, kv, codec):
    a, b = pair
    layers, blocks = 8, 6
    tag = uuid.uuid4().hex[:6]
    shape = list(kv.shape[1:])
    sources = []
    for layer in range(layers):
        data = kv[layer * blocks:(layer + 1) * blocks]
        a.client.region_from_tensor(f"src{tag}-{layer}", data)
        b.client.create_region(f"dst{tag}-{layer}", 10, shape, "bfloat16")
        sources.append(data)
    pairs = [(f"src{tag}-{layer}", f"dst{tag}-{layer}") for layer in range(layers)]
    src_blocks = {"ranges": [{"start": 1, "count": 3, "stride": 2}, {"start": 0, "count": 2, "stride": 2}]}
    dst_blocks = range(9, 4, -1)  # 9, 8, 7, 6, 5
    transfer = a.client.submit_regions(pairs, src_blocks, b.data, dst_blocks, codec=codec)
    result = a.client.wait(transfer, timeout=120)
    assert result["state"] == "done" and result["blocks_done"] == layers * 5
    assert len(a.client.transfers()) >= 1 and len(result["regions"]) == layers
    src_ids = [1, 3, 5, 0, 2]
    for layer in range(layers):
        landed = _blocks(b.client, f"dst{tag}-{layer}", [9, 8, 7, 6, 5], kv)
        assert bits_equal(landed, sources[layer][src_ids])
        untouched = _blocks(b.client, f"dst{tag}-{layer}", [0, 1, 2, 3, 4], kv)
        assert not untouched.view(torch.uint8).any()


@pytest.mark.parametrize("codec", ["raw", "splitzip"])
def test_spread_block_ids_move_a_block_across_planes(pair, kv, codec):
    """``{ids, count, stride}``: each id stands for ``count`` ids ``stride`` apart, as a vLLM block
    does across an in-place cache's layers and K/V (three planes of four blocks here)."""
    a, b = pair
    tag = uuid.uuid4().hex[:6]
    a.client.region_from_tensor(f"src{tag}", kv[:12])
    b.client.create_region(f"dst{tag}", 12, list(kv.shape[1:]), "bfloat16")
    src = {"ids": [0, 2], "count": 3, "stride": 4}  # 0, 4, 8, 2, 6, 10
    dst = {"ids": [3, 1], "count": 3, "stride": 4}  # 3, 7, 11, 1, 5, 9
    result = a.client.wait(a.client.submit(f"src{tag}", src, b.data, f"dst{tag}", dst, codec=codec), timeout=120)
    assert result["state"] == "done" and result["blocks_done"] == 6
    assert bits_equal(_blocks(b.client, f"dst{tag}", [3, 7, 11, 1, 5, 9], kv), kv[[0, 4, 8, 2, 6, 10]])
    assert not _blocks(b.client, f"dst{tag}", [0, 2, 4, 6, 8, 10], kv).view(torch.uint8).any()
    with pytest.raises(errors.InvalidBlocks, match="in 0..11"):  # 1 + 3·6 = 19 is past the region
        a.client.submit(f"src{tag}", {"ids": [1], "count": 4, "stride": 6}, b.data, f"dst{tag}", range(4))


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="needs IPv6 on loopback (::1)")
def test_sidecars_on_ipv6_move_kv_and_give_their_address_in_brackets(kv):
    """An IPv6-only cluster: each data listener on ``::1``; the address a sidecar gives is
    ``[::1]:port``, which its peers (and URLs) read back whole."""
    ipv6 = ["--data-host", "::1", "--advertise-host", "::1"]
    a, b = spawn(extra=ipv6), spawn(extra=ipv6)
    try:
        assert b.data.startswith("[::1]:") and b.data.rpartition(":")[2].isdigit()
        a.client.region_from_tensor("src", kv[:8])
        b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
        for ids in ([3], list(range(8))):  # one block rides inline; eight are streamed
            result = a.client.send("src", ids, b.data, "dst", ids[::-1], codec="raw", wait=60)
            assert result["state"] == "done", result
            assert b.client.transfer(result["id"])["state"] == "done"
            assert bits_equal(_blocks(b.client, "dst", ids[::-1], kv), kv[ids])
    finally:
        stop(a, b)


def test_packed_block_ids_move_as_their_json_twins(pair, kv):
    """``{packed, count?, stride?}``: the ids as base64 of little-endian u32, plain or spread,
    land where the same ids as JSON numbers land; malformed packings are refused at submit."""
    a, b = pair
    tag = uuid.uuid4().hex[:6]
    a.client.region_from_tensor(f"src{tag}", kv[:12])
    b.client.create_region(f"dst{tag}", 12, list(kv.shape[1:]), "bfloat16")
    result = a.client.send(f"src{tag}", packed([0, 2], 3, 4), b.data, f"dst{tag}", packed([3, 1], 3, 4), codec="raw",
                           wait=60)
    assert result["state"] == "done" and result["blocks_done"] == 6
    assert bits_equal(_blocks(b.client, f"dst{tag}", [3, 7, 11, 1, 5, 9], kv), kv[[0, 4, 8, 2, 6, 10]])
    result = a.client.send(f"src{tag}", packed([11, 1]), b.data, f"dst{tag}", packed([0, 2]), codec="raw", wait=60)
    assert result["state"] == "done" and bits_equal(_blocks(b.client, f"dst{tag}", [0, 2], kv), kv[[11, 1]])
    for bad, why in (({"packed": "***"}, "not base64"), ({"packed": "AQID"}, "multiple of 4"),
                     ({"packed": packed([1])["packed"], "count": 2}, "needs a stride"),
                     ({"packed": packed([1])["packed"], "extra": 1}, "extra")):
        with pytest.raises(errors.BadRequest, match=why):
            a.client.submit(f"src{tag}", bad, b.data, f"dst{tag}", [0])
    with pytest.raises(errors.InvalidBlocks, match="in 0..11"):
        a.client.submit(f"src{tag}", packed([12]), b.data, f"dst{tag}", [0])
    with pytest.raises(ValueError, match="2\\*\\*32"):
        packed([-1])


def test_mismatched_block_counts_and_unknown_codecs_are_refused_at_submit(pair, kv):
    a, b = pair
    src = f"s{uuid.uuid4().hex[:8]}"
    a.client.region_from_tensor(src, kv[:4])
    with pytest.raises(errors.BadRequest, match="destination blocks"):
        a.client.submit(src, [0, 1], b.data, "x", [0])
    with pytest.raises(errors.BadRequest, match="no codec named"):
        a.client.submit(src, [0], b.data, "x", [0], codec="zstd")
    with pytest.raises(errors.InvalidBlocks):
        a.client.submit(src, {"ranges": [{"start": 2, "count": 3}]}, b.data, "x", range(3))


def test_the_client_imports_no_server_code():
    code = ("import sys, kvferry.client; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'kvferry.api', 'kvferry.engine.engine', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_async_client_submits_waits_and_raises(pair, kv):
    import asyncio

    from kvferry.client import AsyncClient
    from tests.engine.conftest import TOKEN

    a, b = pair
    a.client.region_from_tensor("async-src", kv[:3])
    b.client.create_region("async-dst", 3, list(kv.shape[1:]), "bfloat16")

    async def main():
        async with AsyncClient(a.url, token=TOKEN) as client:
            peer = b.data
            done = await client.wait(await client.submit("async-src", range(3), peer, "async-dst", [2, 1, 0],
                                                         codec="splitzip"), timeout=60)
            assert done["state"] == "done" and done["blocks_done"] == 3
            b.client.delete_region("async-dst")
            with pytest.raises(errors.TransferFailed, match="NotFound"):
                await client.wait(await client.submit("async-src", [0], peer, "async-dst", [0]), timeout=30)

    asyncio.run(main())


def test_a_whole_request_is_one_transfer(pair):
    """A vLLM request's shape: the same 256 block ids across 32 layer regions, one transfer, with the
    destination ids a shifted range (small blocks keep it quick)."""
    a, b = pair
    tag = uuid.uuid4().hex[:6]
    layers, blocks, shape = 32, 256, [2, 4, 8]
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(blocks, *shape, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    segments = []
    for layer, data in enumerate(sources):
        segments.append(a.client.region_from_tensor(f"rq{tag}{layer}", data, kind="shm")[1])
        b.client.create_region(f"rd{tag}{layer}", 2 * blocks, shape, "bfloat16")
    for segment in segments:  # the sidecar keeps its mapping; the name can go now
        segment.close()
        segment.unlink()
    pairs = [(f"rq{tag}{layer}", f"rd{tag}{layer}") for layer in range(layers)]
    before = len(b.client.transfers(direction="in"))
    result = a.client.wait(a.client.submit_regions(pairs, range(blocks), b.data, range(blocks, 2 * blocks),
                                                   codec="raw"), timeout=120)
    assert result["state"] == "done" and result["blocks_done"] == layers * blocks
    assert len(b.client.transfers(direction="in")) == before + 1
    for layer in (0, 17, 31):
        got = _blocks(b.client, f"rd{tag}{layer}", [blocks, blocks + 100, 2 * blocks - 1], sources[layer])
        assert bits_equal(got, sources[layer][[0, 100, blocks - 1]])


def test_a_slow_link_tapers_the_plan_at_both_ends_and_stays_exact(kv):
    """Where a chunk spends long on the link (here an emulated 0.2 GB/s), the sender tapers the
    chunk plan (its first and last chunks split) and says so in the announce, and the receiver
    follows the same plan; on a fast link the plan stays plain. The receiver's chunk counter
    shows which plan ran; the blocks are exact either way."""
    from kvferry.engine import peer

    blocks = 40
    per_chunk = (2 << 20) // (kv[0].numel() * kv.element_size())
    order = list(range(blocks - 1, -1, -1))
    for link, tapered in ((("KVFERRY_EMULATED_LINK_GBPS", "0.2"), True), (("KVFERRY_ASSUMED_LINK_GBPS", "1000"), False)):
        env = {"KVFERRY_CHUNK_BYTES": str(2 << 20), "KVFERRY_TRANSFER_TIMEOUT": "30", link[0]: link[1]}
        a, b = spawn("tcp", env), spawn("tcp", env)
        try:
            a.client.region_from_tensor("src", kv[:blocks])
            b.client.create_region("dst", blocks, list(kv.shape[1:]), "bfloat16")
            transfer = a.client.submit("src", range(blocks), b.data, "dst", order, codec="splitzip")
            assert a.client.wait(transfer, timeout=60)["state"] == "done"
            assert _counter(b.client, "kvferry_chunks") == len(peer.plan_chunks(blocks, (per_chunk,), tapered))
            assert bits_equal(_blocks(b.client, "dst", order, kv), kv[:blocks])
        finally:
            stop(a, b)
    assert len(peer.plan_chunks(blocks, (per_chunk,), True)) == len(peer.plan_chunks(blocks, (per_chunk,))) + 2
