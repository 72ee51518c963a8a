"""Three hosts through a switch (a bridge namespace): two senders fill one receiver at once, each
over its own cable shaped to 500 Mbit/s, bit for bit."""

from __future__ import annotations

import pytest

from tests.net.conftest import blocks_of, over_the_wire, same_bits

pytestmark = pytest.mark.slow


def test_two_senders_one_receiver_through_a_switch(networks, kv):
    net = networks("a", "b", "c")
    net.shape_all(500)
    env = {"KVFERRY_TRANSFER_TIMEOUT": "30"}
    a, b, c = (net.sidecar(name, env) for name in "abc")
    halves = {"a": kv[:30], "b": kv[30:]}
    for sender, name in ((a, "a"), (b, "b")):
        sender.client.region_from_tensor("src", halves[name])
        c.client.create_region(f"from-{name}", 30, list(kv.shape[1:]), "bfloat16")
    reversed_ids = list(range(29, -1, -1))
    transfers = [(s, s.client.submit("src", range(30), c.data_address, f"from-{n}", reversed_ids, codec=codec))
                 for s, n, codec in ((a, "a", "splitzip"), (b, "b", "raw"))]  # both in flight at once
    for sender, transfer in transfers:
        record = sender.client.wait(transfer, timeout=120)
        over_the_wire(record)
    for name in "ab":
        got = blocks_of(c, f"from-{name}", reversed_ids, kv.shape[1:])
        assert same_bits(got, halves[name]), name
