"""One message that a slow link carries for longer than ``transfer_timeout`` (on a GPU a chunk is one
message of up to 256 MiB, and a backend lands a message only once it is whole): while the link moves
it faster than the floor rate (``min_peer_bytes_per_s``) it is progress on both sides, and the
transfer is done; cut mid-message, the transfer fails on both sides within the timeout plus the time
the message's bytes take at the floor, and the next one is done."""

from __future__ import annotations

import time

import pytest

from tests.net.conftest import blocks_of, on_a_cable, same_bits
from tests.net.test_faults import SLACK, _ended, _until

pytestmark = pytest.mark.slow
TIMEOUT = 3.0
RATE_MBIT = 40  # 5 MB/s (4.8 MiB/s): one 32 MiB message takes ~7 s, over twice the timeout
FLOOR = 4 << 20  # under the link's rate; a 32 MiB message is given 8 s on top of the timeout
MESSAGE = 32 << 20
ENV = {"KVFERRY_TRANSFER_TIMEOUT": str(TIMEOUT), "KVFERRY_CHUNK_BYTES": str(MESSAGE),
       "KVFERRY_TRANSPORT_CHUNK_BYTES": str(MESSAGE + (1 << 20)), "KVFERRY_MIN_PEER_BYTES_PER_S": str(FLOOR)}


def _on_a_slow_link(networks, kv, backend: str):
    """Sidecars a and b over a cable shaped to RATE_MBIT, a holding 47 MB of real KV (a 32 MiB
    message and a smaller one), b a region for it: (network, a, b, the KV)."""
    net = networks("a", "b")
    return (net, *on_a_cable(net, kv, RATE_MBIT, ENV, backend))


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_a_message_longer_than_the_timeout_on_a_slow_link_is_done(networks, kv, backend):
    _, a, b, big = _on_a_slow_link(networks, kv, backend)
    ids = list(range(big.shape[0]))
    started = time.monotonic()
    transfer = a.client.submit("src", ids, b.data_address, "dst", ids[::-1], codec="raw")
    record = a.client.wait(transfer, timeout=120)
    took = time.monotonic() - started
    assert record["state"] == "done", (record, b.log_tail())
    assert b.client.transfer(transfer)["state"] == "done"
    assert took > 2 * TIMEOUT  # the link was as slow as meant: its first message took longer than the timeout
    assert same_bits(blocks_of(b, "dst", ids[::-1], big.shape[1:]), big)


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_a_link_cut_mid_message_fails_in_time_and_the_next_transfer_is_done(networks, kv, backend):
    net, a, b, big = _on_a_slow_link(networks, kv, backend)
    ids = list(range(big.shape[0]))
    transfer = a.client.submit("src", ids, b.data_address, "dst", ids, codec="raw")
    time.sleep(2.0)  # the first message is on the link, a third of it across
    net.cut("a")
    allowed = TIMEOUT + MESSAGE / FLOOR
    for side in (a, b):
        record, took = _until(side, transfer, _ended, allowed + SLACK + 30)
        assert record["state"] == "failed" and record["error"], record
        assert took < allowed + SLACK, f"failed {took:.1f} s after the cut: {record}"
    net.heal("a")
    few = list(range(8))
    record = a.client.wait(a.client.submit("src", few, b.data_address, "dst", few, codec="raw"), timeout=60)
    assert record["state"] == "done", record
    assert same_bits(blocks_of(b, "dst", few, big.shape[1:]), big[:8])
