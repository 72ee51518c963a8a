"""Two sidecars whose data connections have three TCP lanes: real KV, chunks large enough to be
spread over the lanes, bit-exact, raw and compressed (real processes and ports)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def laned_pair():
    env = {"KVFERRY_TCP_LANES": "3", "KVFERRY_CHUNK_BYTES": str(8 << 20), "KVFERRY_TRANSFER_TIMEOUT": "20"}
    a, b = spawn("tcp", env), spawn("tcp", env)
    yield a, b
    stop(a, b)


@pytest.mark.parametrize("codec_name", ["raw", "splitzip"])
def test_transfers_over_lanes_are_bit_exact(laned_pair, kv, codec_name):
    a, b = laned_pair
    blocks = torch.cat([kv] * max(1, -(-(24 << 20) // (kv.numel() * 2))))[:96]  # ~24 MiB of real KV
    src, dst = f"src-{codec_name}", f"dst-{codec_name}"
    a.client.region_from_tensor(src, blocks)
    b.client.create_region(dst, len(blocks) + 8, list(blocks.shape[1:]), "bfloat16")
    ids = list(range(len(blocks)))
    transfer = a.client.submit(src, ids, b.data, dst, [i + 8 for i in ids], codec=codec_name)
    result = a.client.wait(transfer, timeout=120)
    assert result["state"] == "done", result
    raw = b"".join(b.client.get_block(dst, i + 8) for i in ids)
    got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.bfloat16).view(blocks.shape)
    assert bits_equal(got, blocks)
    assert not any(b.client.get_block(dst, i).strip(b"\0") for i in range(8))  # blocks not named: untouched
