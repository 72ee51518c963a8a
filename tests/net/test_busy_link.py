"""Many transfers sharing one slow link: each waits its turn behind the others on their one data
connection, longer than ``transfer_timeout``, and is done, not failed for waiting (the link busy all
the while is progress), small ones whose chunks ride inline in their announce too; the receiver killed
under them ends every one at once, cleanly."""

from __future__ import annotations

import time

import pytest

from tests.net.conftest import blocks_of, on_a_cable, same_bits

pytestmark = pytest.mark.slow
TIMEOUT = 3.0
RATE_MBIT = 80  # 10 MB/s: the 47 MB of all sixteen take the link ~4.7 s, the last ones wait past TIMEOUT
TRANSFERS = 16
ENV = {"KVFERRY_TRANSFER_TIMEOUT": str(TIMEOUT), "KVFERRY_CHUNK_BYTES": str(4 << 20)}


def _sixteen_on_the_link(networks, kv, backend: str):
    """Sidecars a and b over a cable shaped to RATE_MBIT, a holding 240 blocks (47 MB) of real KV,
    and TRANSFERS transfers of a share each submitted at once, each into its blocks of b's region
    in reverse order: (network, a, b, the KV, the parts, the transfer ids)."""
    net = networks("a", "b")
    a, b, big = on_a_cable(net, kv, RATE_MBIT, ENV, backend)
    per = big.shape[0] // TRANSFERS
    parts = [list(range(k * per, (k + 1) * per)) for k in range(TRANSFERS)]
    submitted = [a.client.submit("src", part, b.data_address, "dst", part[::-1], codec="raw") for part in parts]
    return net, a, b, big, parts, submitted


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_transfers_queued_on_a_busy_link_past_the_timeout_are_done(networks, kv, backend):
    _, a, b, big, parts, submitted = _sixteen_on_the_link(networks, kv, backend)
    for transfer_id in submitted:
        record = a.client.wait(transfer_id, timeout=120)
        assert record["state"] == "done", (record, b.log_tail())
        assert b.client.transfer(transfer_id)["state"] == "done"
    ids = [i for part in parts for i in part[::-1]]
    assert same_bits(blocks_of(b, "dst", ids, big.shape[1:]), big[[i for part in parts for i in part]])


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_the_receiver_killed_under_many_transfers_ends_every_one_and_logs_no_error(networks, kv, backend):
    """Sixteen transfers on the link and the receiver killed: every one ends at once (failed, or
    done if it was), none waits out a timeout, the sender logs no error (its sends, cancelled as
    their transfers end, leave none unretrieved), and a receiver started again takes the next."""
    net, a, b, big, parts, submitted = _sixteen_on_the_link(networks, kv, backend)
    per = len(parts[0])
    time.sleep(1.0)  # some done, the rest on the link or queued behind it
    b.kill()
    killed = time.monotonic()
    states = []
    for transfer_id in submitted:
        while (record := a.client.transfer(transfer_id))["state"] in ("queued", "running"):
            assert time.monotonic() - killed < TIMEOUT, record  # the loss is seen at once, not timed out
            time.sleep(0.05)
        states.append(record["state"])
    assert "failed" in states and set(states) <= {"done", "failed"}, states
    b = net.sidecar("b", ENV, backend=backend)
    b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
    record = a.client.wait(a.client.submit("src", range(per), b.data_address, "dst", range(per), codec="raw"),
                           timeout=60)
    assert record["state"] == "done", record
    assert same_bits(blocks_of(b, "dst", list(range(per)), big.shape[1:]), big[:per])
    assert " ERROR " not in a.log.read_text(errors="replace"), a.log_tail()


INLINE_ENV = {"KVFERRY_TRANSFER_TIMEOUT": "3", "KVFERRY_CHUNK_BYTES": str(256 << 10)}


@pytest.mark.parametrize("backend", ["tcp", "ucxx"])
def test_small_inline_transfers_behind_a_streamed_one_on_a_slow_link_are_done(networks, kv, backend):
    """A streamed transfer, then forty-four small ones whose chunks ride inline in their announce,
    all on one connection over a 40 Mbit/s link: the last announces go out ~9 s after they are
    posted, far past the 3 s timeout (which covers the kernel's send buffer draining, ~1.7 s). Each
    is given its time from when its announce is out (not from when it was posted), and the
    receiver counts the inline bytes arriving as progress of the connection (the streamed one
    waiting its turn behind them is not failed for "no data")."""
    net = networks("a", "b")
    a, b, big = on_a_cable(net, kv, 40, INLINE_ENV, backend)
    streamed = list(range(60))
    smalls = [list(range(i, i + 4)) for i in range(60, big.shape[0] - 4, 4)]
    submitted = [a.client.submit("src", streamed, b.data_address, "dst", streamed[::-1], codec="raw")]
    submitted += [a.client.submit("src", ids, b.data_address, "dst", ids[::-1], codec="raw") for ids in smalls]
    for transfer_id in submitted:
        record = a.client.wait(transfer_id, timeout=120)
        assert record["state"] == "done", (record, b.log_tail())
        assert b.client.transfer(transfer_id)["state"] == "done"
    parts = [streamed, *smalls]
    ids = [i for part in parts for i in part[::-1]]
    assert same_bits(blocks_of(b, "dst", ids, big.shape[1:]), big[[i for part in parts for i in part]])
