"""Two real sidecar processes move real KV over real HTTP and the real transport."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry import codec
from kvferry.engine import errors
from tests.conftest import bits_equal

pytestmark = pytest.mark.slow


def _name() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


def _blocks(client, region: str, ids: list[int], like: torch.Tensor) -> torch.Tensor:
    raw = b"".join(client.get_block(region, i) for i in ids)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).view(len(ids), *like.shape[1:])


@pytest.mark.parametrize("codec_name", ["raw", "splitzip", "entropy", "auto"])
def test_owned_to_owned_real_kv_bit_exact(pair, kv, codec_name):
    a, b = pair
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, kv)
    b.client.create_region(dst, 80, list(kv.shape[1:]), "bfloat16")
    src_ids = list(range(0, 60, 2)) + list(range(1, 60, 2))
    dst_ids = [79 - i for i in range(60)]
    transfer = a.client.submit(src, src_ids, b.data, dst, dst_ids, codec=codec_name)
    result = a.client.wait(transfer, timeout=120)
    assert result["state"] == "done", result
    assert bits_equal(_blocks(b.client, dst, dst_ids, kv), kv[src_ids])
    untouched = _blocks(b.client, dst, list(range(20)), kv)
    assert not untouched.view(torch.uint8).any()  # blocks not named were not written
    incoming = b.client.transfer(transfer)
    assert incoming["direction"] == "in" and incoming["state"] == "done"
    assert incoming["bytes_raw"] == kv.numel() * 2
    if codec_name == "splitzip":
        assert result["ratio"] > 1.3
    if codec_name == "entropy":  # a codebook learned from the region's first blocks
        assert result["ratio"] > 1.4
    if codec_name == "auto":
        # auto chooses among the lossless codecs that need nothing but the data; once the
        # plausible ones have moved transfers of this size to this peer, by their measured speeds
        reason = result["choice_reason"]
        lossless = [c.name for c in codec.lossless()]
        assert result["chosen_codec"] in lossless and reason.startswith(("predicted", "measured", "trying"))
        if reason.startswith("measured"):
            words = reason.removeprefix("measured ").split(" GB/s")[0].split(" vs ")
            speeds = {name: float(value) for name, value in (w.split() for w in words)}
            assert set(speeds) <= set(lossless) and speeds[result["chosen_codec"]] == max(speeds.values())


def test_shm_to_shm(pair, kv):
    a, b = pair
    src, dst = _name(), _name()
    _, src_shm = a.client.region_from_tensor(src, kv[:20], kind="shm")
    _, dst_shm = b.client.region_from_tensor(dst, torch.zeros_like(kv[:20]), kind="shm")
    try:
        transfer = a.client.submit(src, list(range(20)), b.data, dst, list(range(20)), codec="splitzip")
        assert a.client.wait(transfer, timeout=120)["state"] == "done"
        landed = torch.frombuffer(dst_shm.buf, dtype=torch.uint8, count=kv[:20].numel() * 2)
        assert torch.equal(landed, kv[:20].contiguous().view(-1).view(torch.uint8))  # in the worker's memory
        del landed
    finally:
        for client, name in ((a.client, src), (b.client, dst)):
            client.delete_region(name)
        for shm in (src_shm, dst_shm):
            shm.close()
            shm.unlink()


def test_many_concurrent_transfers(pair, kv):
    a, b = pair
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, kv)
    b.client.create_region(dst, 60, list(kv.shape[1:]), "bfloat16")
    ids = [transfer_id for transfer_id in
           (a.client.submit(src, [i, i + 30], b.data, dst, [i, i + 30], codec="splitzip" if i % 2 else "raw")
            for i in range(12))]
    results = [a.client.wait(i, timeout=120) for i in ids]
    assert [r["state"] for r in results] == ["done"] * 12
    sent = [i for k in range(12) for i in (k, k + 30)]
    assert bits_equal(_blocks(b.client, dst, sent, kv), kv[sent])


def test_cancel_mid_transfer(pair, kv):
    a, b = pair
    big = kv.repeat(6, 1, 1, 1)  # 360 blocks, 70 MB
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, big)
    b.client.create_region(dst, big.shape[0], list(big.shape[1:]), "bfloat16")
    transfer = a.client.submit(src, list(range(big.shape[0])), b.data, dst, list(range(big.shape[0])), codec="splitzip")
    deadline = time.monotonic() + 30
    while a.client.transfer(transfer)["bytes_wire"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # until chunks are on the wire: announced, mid-transfer
    with pytest.raises(errors.Conflict, match="in use"):
        a.client.delete_region(src)  # the transfer is reading it
    a.client.cancel(transfer)
    with pytest.raises(errors.TransferFailed, match="cancelled by request") as failed:
        a.client.wait(transfer, timeout=30)
    assert failed.value.state == "cancelled"
    incoming = b.client.transfer(transfer, wait=30)
    assert incoming["state"] in ("cancelled", "failed") and incoming["error"], incoming
    assert incoming["blocks_done"] < big.shape[0]
    with pytest.raises(errors.Conflict):
        a.client.cancel(transfer)
    b.client.delete_region(dst)  # not busy any more
    a.client.delete_region(src)


def test_bad_requests_get_clear_errors(pair, kv):
    a, b = pair
    src = _name()
    a.client.region_from_tensor(src, kv[:4])
    with pytest.raises(errors.InvalidBlocks, match="0..3"):
        a.client.submit(src, [0, 9], b.data, "x", [0, 1])
    with pytest.raises(errors.InvalidBlocks, match="repeat"):
        a.client.submit(src, [1, 1], b.data, "x", [0, 1])
    with pytest.raises(errors.NotFound):
        a.client.submit("nope", [0], b.data, "x", [0])
    with pytest.raises(errors.BadRequest):
        a.client.put_block(src, 0, b"short")
    headers = {"Authorization": "Bearer test-token-123"}
    malformed = httpx.post(f"{a.url}/v1/transfers", content=b"{not json", headers=headers)
    assert malformed.status_code == 422 and malformed.json()["error"] == "BadRequest"
    huge = httpx.put(f"{a.url}/v1/regions/{src}/blocks/0", content=b"\0" * (65 << 20), headers=headers)
    assert huge.status_code == 413 and huge.json()["error"] == "PayloadTooLarge"
    unauthorized = httpx.get(f"{a.url}/v1/regions", headers={"Authorization": "Bearer wrong"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"] == "Unauthorized"
    assert httpx.get(f"{a.url}/healthz").status_code == 200  # health needs no token
    # A destination that does not fit: the receiver refuses before anything moves.
    dst = _name()
    b.client.create_region(dst, 2, [3, 511, 32], "bfloat16")
    transfer = a.client.submit(src, [0], b.data, dst, [0], codec="raw")
    with pytest.raises(errors.TransferFailed, match="BadRequest") as failed:
        a.client.wait(transfer, timeout=30)
    assert failed.value.state == "failed"
    with pytest.raises(errors.BadRequest, match="data listener"):
        a.client.submit(src, [0], b.url, dst, [0])  # a control URL is not where chunks go


def test_metrics_parse_back(pair, kv):
    a, b = pair
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, kv[:8])
    b.client.create_region(dst, 8, list(kv.shape[1:]), "bfloat16")
    assert a.client.wait(a.client.submit(src, list(range(8)), b.data, dst, list(range(8)), codec="splitzip"),
                         timeout=60)["state"] == "done"
    families = {f.name: f for f in text_string_to_metric_families(a.client.metrics())}
    done = [s for s in families["kvferry_transfers"].samples
            if s.name == "kvferry_transfers_total"
            and s.labels == {"state": "done", "direction": "out", "codec": "splitzip"}]
    assert done and done[0].value >= 1
    assert any(s.value > 0 for s in families["kvferry_bytes_wire"].samples if s.name.endswith("_total"))
    for name in ("kvferry_compression_ratio", "kvferry_transfer_seconds", "kvferry_inflight_chunks",
                 "kvferry_errors", "kvferry_regions", "kvferry_codec_seconds", "kvferry_build_info"):
        assert name in families, name


def test_openapi_documents_the_api(pair):
    a, _ = pair
    paths = httpx.get(f"{a.url}/openapi.json").json()["paths"]
    assert "/v1/incoming" not in paths  # peers talk on the data connection, not here
    for path in ("/healthz", "/readyz", "/metrics", "/v1/health", "/v1/regions", "/v1/regions/{name}",
                 "/v1/regions/{name}/blocks/{index}", "/v1/transfers", "/v1/transfers/{transfer_id}",
                 "/v1/codebooks/{name}", "/v1/codebooks/{name}/calibrate"):
        assert path in paths, path



def test_codebooks_calibrate_store_and_use(pair, kv):
    a, b = pair
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, kv)
    b.client.create_region(dst, 60, list(kv.shape[1:]), "bfloat16")
    book = a.client.calibrate("k-layers", src, list(range(0, 60, 2)))
    assert book["codec"] == "splitzip" and len(book["digest"]) == 16
    stored = httpx.get(f"{a.url}/v1/codebooks/k-layers", headers={"Authorization": "Bearer test-token-123"}).json()
    assert stored["dtype"] == "bfloat16" and stored["coverage"] > 0.999 and len(stored["exponents"]) == 16
    a.client.put_codebook("copy", httpx.get(f"{a.url}/v1/codebooks/k-layers",
                                            headers={"Authorization": "Bearer test-token-123"}).text)
    ids = list(range(0, 60, 2))
    result = a.client.wait(a.client.submit(src, ids, b.data, dst, ids, codec="splitzip", codebook="copy"), timeout=60)
    assert result["state"] == "done" and result["ratio"] > 1.3
    assert bits_equal(_blocks(b.client, dst, ids, kv), kv[ids])
    with pytest.raises(errors.NotFound):
        a.client.submit(src, [0], b.data, dst, [0], codec="splitzip", codebook="missing")
    with pytest.raises(errors.BadRequest):
        a.client.put_codebook("broken", '{"format": "kvferry-codebook", "version": 1, "dtype": "bfloat16"}')
    listed = b.client.transfers(direction="in", state="done")
    assert result["id"] in {t["id"] for t in listed}
