"""Lossy codecs through real sidecars: only when named, labelled lossy on both sides and in the
metrics, the receiver holds exactly the codec's reconstruction, and a codec that cannot code a
region (no layout, no codebook, a codebook for another model) is refused before anything is sent."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry import codec
from kvferry.engine import errors
from tests.conftest import bits_equal
from tests.engine.conftest import TOKEN, spawn, stop

pytestmark = pytest.mark.slow

AXES = ("kv", "token", "head", "channel")


def _name() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def daemons():
    a, b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "20"}), spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "20"})
    yield a, b
    stop(a, b)


def layer_blocks(kv: torch.Tensor, layer: int, block_tokens: int = 16) -> torch.Tensor:
    """Real KV of one layer as vLLM-like blocks [block, kv, token, head, channel]."""
    k, v = kv[2 * layer], kv[2 * layer + 1]  # [head, token, channel]
    n = k.shape[1] // block_tokens
    both = torch.stack([k, v])[:, :, :n * block_tokens]  # [2, head, token, channel]
    return both.view(2, k.shape[0], n, block_tokens, k.shape[2]).permute(2, 0, 3, 1, 4).contiguous()


def _received(client, region: str, ids: list[int], like: torch.Tensor) -> torch.Tensor:
    raw = b"".join(client.get_block(region, i) for i in ids)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).view(len(ids), *like.shape[1:])


def _reconstructed(name: str, blocks: torch.Tensor, book=None) -> torch.Tensor:
    """What the codec's CPU reference makes of ``blocks``."""
    c = codec.get(name)
    bound = c.bind(book, codec.BlockLayout(tuple(blocks.shape[1:]), AXES))
    ids = torch.arange(blocks.shape[0])
    out = torch.zeros_like(blocks)
    c.decode_blocks(c.encode_blocks(blocks, ids, bound), out, ids, bound)
    return out


def _metric(url: str, name: str, labels: dict) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.mark.parametrize("name", ["k8v4", "k4v2"])
def test_named_quantizer_is_lossy_and_delivers_its_reconstruction(daemons, kv, name):
    a, b = daemons
    blocks = layer_blocks(kv, 5)
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, blocks, axes=AXES)
    b.client.create_region(dst, 40, list(blocks.shape[1:]), "bfloat16", axes=list(AXES))
    ids, dst_ids = list(range(0, 30, 3)), list(range(30, 40))
    before = _metric(a.url, "kvferry_lossy_bytes_raw_total", {"direction": "out", "codec": name})
    result = a.client.wait(a.client.submit(src, ids, b.data, dst, dst_ids, codec=name), timeout=60)
    assert result["state"] == "done" and result["lossy"] is True and result["chosen_codec"] == name
    assert result["ratio"] > (2.4 if name == "k8v4" else 4.0)
    incoming = b.client.transfer(result["id"])
    assert incoming["lossy"] is True and incoming["chosen_codec"] == name
    got = _received(b.client, dst, dst_ids, blocks)
    assert bits_equal(got, _reconstructed(name, blocks[ids]))
    assert not bits_equal(got, blocks[ids])  # it is lossy: the test would pass a raw copy otherwise
    assert _metric(a.url, "kvferry_lossy_bytes_raw_total", {"direction": "out", "codec": name}) - before == \
        blocks[ids].numel() * 2


def test_auto_never_picks_a_lossy_codec(daemons, kv):
    assert {"k8v4", "k4v2", "lowrank", "predictive"} <= set(codec.names())
    assert not {c.name for c in codec.lossless()} & {"k8v4", "k4v2", "lowrank", "predictive"}
    a, b = daemons
    blocks = layer_blocks(kv, 2)
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, blocks, axes=AXES)
    b.client.create_region(dst, 31, list(blocks.shape[1:]), "bfloat16", axes=list(AXES))
    result = a.client.wait(a.client.submit(src, list(range(31)), b.data, dst, list(range(31))), timeout=60)
    assert result["state"] == "done" and result["lossy"] is False
    assert codec.get(result["chosen_codec"]).lossless
    assert bits_equal(_received(b.client, dst, list(range(31)), blocks), blocks)


def test_refused_before_anything_is_sent(daemons, kv):
    a, b = daemons
    blocks = layer_blocks(kv, 1)
    unnamed, named, twin, dst = _name(), _name(), _name(), _name()
    a.client.region_from_tensor(unnamed, blocks)  # no axes: which half is K is unknown
    a.client.region_from_tensor(named, blocks, axes=AXES)
    a.client.region_from_tensor(twin, blocks, axes=AXES)
    b.client.create_region(dst, 31, list(blocks.shape[1:]), "bfloat16", axes=list(AXES))
    seen = len(b.client.transfers(direction="in"))
    with pytest.raises(errors.BadRequest, match="kv"):
        a.client.submit(unnamed, [0], b.data, dst, [0], codec="k8v4")
    with pytest.raises(errors.BadRequest, match="needs a codebook"):
        a.client.submit(named, [0], b.data, dst, [0], codec="lowrank")
    with pytest.raises(errors.BadRequest, match="codebook"):
        a.client.submit(named, [0], b.data, dst, [0], codec="predictive")
    with pytest.raises(errors.BadRequest, match="reference regions"):
        a.client.submit(named, [0], b.data, dst, [0], references=(twin, dst))  # auto: nothing codes against them
    with pytest.raises(errors.BadRequest, match="axes"):
        a.client.submit(named, [0], b.data, dst, [0], codec="predictive", references=(unnamed, dst))
    with pytest.raises(errors.BadRequest, match="own reference"):
        a.client.submit(named, [0], b.data, dst, [0], codec="predictive", references=(named, dst))
    assert len(b.client.transfers(direction="in")) == seen


def test_lowrank_with_a_codebook_both_sides_hold(daemons, kv):
    a, b = daemons
    calib, blocks = layer_blocks(kv, 7), layer_blocks(kv, 7)
    src, dst, other = _name(), _name(), _name()
    a.client.region_from_tensor(src, blocks, axes=AXES)
    b.client.create_region(dst, 31, list(blocks.shape[1:]), "bfloat16", axes=list(AXES))
    book = _name()
    a.client.calibrate(book, src, list(range(0, 31, 2)), codec="lowrank", energy=0.99)
    text = httpx.get(f"{a.url}/v1/codebooks/{book}", headers={"Authorization": f"Bearer {TOKEN}"}).text

    # The receiver does not hold it yet: the transfer fails, nothing is written as done.
    failed = a.client.submit(src, [1, 3], b.data, dst, [1, 3], codec="lowrank", codebook=book)
    with pytest.raises(errors.TransferFailed, match="codebook"):
        a.client.wait(failed, timeout=60)

    httpx.put(f"{b.url}/v1/codebooks/{book}", params={"codec": "lowrank"}, content=text,
              headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
    ids = list(range(1, 31, 2))
    result = a.client.wait(a.client.submit(src, ids, b.data, dst, ids, codec="lowrank", codebook=book), timeout=60)
    assert result["state"] == "done" and result["lossy"] is True and result["ratio"] > 1.0
    lowrank = codec.get("lowrank")
    expected = _reconstructed("lowrank", blocks[ids], lowrank.codebook_from_json(text))
    assert bits_equal(_received(b.client, dst, ids, blocks), expected)
    del calib

    # A codebook for another head count is refused at submit.
    narrow = blocks[:, :, :, :2].contiguous()
    a.client.region_from_tensor(other, narrow, axes=AXES)
    with pytest.raises(errors.BadRequest, match="lowrank"):
        a.client.submit(other, [0], b.data, dst, [0], codec="lowrank", codebook=book)


def test_predictive_codes_against_reference_regions_on_each_side(daemons):
    """Lossless against a predictor's KV: each side names its region holding it; bit-exact."""
    import numpy as np

    from kvferry.codec.predictive import calibrate_predictive
    from tests.conftest import DATA

    z = np.load(DATA / "predictive_pair.npz")
    target, predictor = (torch.from_numpy(z[k].view(np.int16)).view(torch.bfloat16) for k in ("target", "predictor"))
    axes = ("layer", "kv", "head", "token", "channel")
    book = calibrate_predictive(target[..., :32, :], predictor[..., :32, :], axes)

    def paged(x: torch.Tensor) -> torch.Tensor:  # [layer, 2, head, 32 tokens, ch] -> 4 blocks of 8 tokens
        return x.reshape(3, 2, 3, 4, 8, 64).permute(3, 0, 1, 2, 4, 5).contiguous()

    region, reference = paged(target[..., 32:, :]), paged(predictor[..., 32:, :])
    a, b = daemons
    src, src_ref, dst, dst_ref, name = _name(), _name(), _name(), _name(), _name()
    a.client.region_from_tensor(src, region, axes=axes)
    a.client.region_from_tensor(src_ref, reference, axes=axes)
    b.client.create_region(dst, 6, list(region.shape[1:]), "bfloat16", axes=list(axes))
    rx_ref = torch.zeros(6, *reference.shape[1:], dtype=reference.dtype)
    rx_ref[[5, 1, 2]] = reference[[3, 0, 2]]  # the receiver's predictor ran on the same prompt
    b.client.region_from_tensor(dst_ref, rx_ref, axes=axes)
    for daemon in (a, b):
        httpx.put(f"{daemon.url}/v1/codebooks/{name}", params={"codec": "predictive"}, content=book.to_json(),
                  headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()

    with pytest.raises(errors.BadRequest, match="reference"):  # the codec refuses to code without one
        a.client.submit(src, [3, 0, 2], b.data, dst, [5, 1, 2], codec="predictive", codebook=name)
    tid = a.client.submit(src, [3, 0, 2], b.data, dst, [5, 1, 2], codec="predictive", codebook=name,
                          references=(src_ref, dst_ref))
    result = a.client.wait(tid, timeout=60)
    assert result["state"] == "done" and result["lossy"] is False and result["ratio"] > 1.5
    assert bits_equal(_received(b.client, dst, [5, 1, 2], region), region[[3, 0, 2]])
    assert b.client.region(dst_ref)["busy_transfers"] == []  # released once done

    # A receiver whose reference region is missing refuses the announce: the transfer fails.
    failed = a.client.submit(src, [0], b.data, dst, [0], codec="predictive", codebook=name,
                             references=(src_ref, "nowhere"))
    with pytest.raises(errors.TransferFailed, match="nowhere"):
        a.client.wait(failed, timeout=60)
