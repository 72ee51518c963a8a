"""More senders than a receiver takes at once (``max_incoming_transfers``): the receiver refuses
the announces beyond its budget before anything is written, the senders' records say
``Overloaded``, and a client waiting for the end sends such a transfer again: every one ends done."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = pytest.mark.slow


def test_transfers_refused_as_overloaded_are_sent_again_and_done():
    b = spawn("tcp", {"KVFERRY_MAX_INCOMING_TRANSFERS": "1"})
    senders = [spawn("tcp") for _ in range(2)]
    try:
        kv = torch.randn(64, 1024, dtype=torch.bfloat16)
        b.client.create_region("dst", 64 * 4, [1024], "bfloat16")
        for s in senders:
            s.client.region_from_tensor("src", kv)

        def send(i: int) -> dict:
            s = senders[i % 2]
            return s.client.send("src", range(64), b.data, "dst", range(64 * (i % 4), 64 * (i % 4) + 64),
                                 codec="raw", wait=60)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            records = list(pool.map(send, range(8)))
        assert [r["state"] for r in records] == ["done"] * 8, [(r["state"], r["error"]) for r in records]
        got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("dst", i)), dtype=torch.bfloat16)
                           for i in range(64)])
        assert bits_equal(got, kv)
        refused = [t for t in b.client.transfers(direction="in") if t["state"] == "failed"]
        assert not refused  # a refusal is not a transfer the receiver took on
    finally:
        stop(b, *senders)
