"""Many transfers sharing one slow link: each waits its turn behind the others on their one data
connection, longer than ``transfer_timeout``, and is done, not failed for waiting; the link busy
all the while is progress."""

from __future__ import annotations

import pytest

from tests.net.conftest import blocks_of, same_bits

pytestmark = pytest.mark.slow
TIMEOUT = 3.0
RATE_MBIT = 80  # 10 MB/s: the 47 MB of all sixteen take the link ~4.7 s, the last ones wait past TIMEOUT
TRANSFERS = 16
ENV = {"KVFERRY_TRANSFER_TIMEOUT": str(TIMEOUT), "KVFERRY_CHUNK_BYTES": str(4 << 20)}


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_transfers_queued_on_a_busy_link_past_the_timeout_are_done(networks, kv, backend):
    net = networks("a", "b")
    net.shape_all(RATE_MBIT)
    a, b = net.sidecar("a", ENV, backend=backend), net.sidecar("b", ENV, backend=backend)
    big = kv.repeat(4, 1, 1, 1)
    a.client.region_from_tensor("src", big)
    b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
    per = big.shape[0] // TRANSFERS
    parts = [list(range(k * per, (k + 1) * per)) for k in range(TRANSFERS)]
    submitted = [a.client.submit("src", part, b.data_address, "dst", part[::-1], codec="raw") for part in parts]
    for transfer_id in submitted:
        record = a.client.wait(transfer_id, timeout=120)
        assert record["state"] == "done", (record, b.log_tail())
        assert b.client.transfer(transfer_id)["state"] == "done"
    ids = [i for part in parts for i in part[::-1]]
    assert same_bits(blocks_of(b, "dst", ids, big.shape[1:]), big[[i for part in parts for i in part]])
