"""Faults only a real network makes: a partition longer than ``transfer_timeout``, a receiver
killed and started again on the same address, a sender killed mid-transfer, with or without its
kernel's goodbye reaching the peer (a reset over a live link, or nothing over a cut one), either
side stalled past the timeout and resumed. Every transfer ends within its timeout with a reason,
never runs forever, and the next one is done and bit-exact."""

from __future__ import annotations

import time

import pytest

from kvferry.engine import errors
from kvferry.testing import netns
from tests.net.conftest import blocks_of, on_a_cable, over_the_wire, same_bits

pytestmark = pytest.mark.slow
TIMEOUT = 3.0  # transfer_timeout of every sidecar here
SLACK = 12.0  # what a loaded 2-core machine may add to it (polling, a busy loop, the kill)
RATE_MBIT = 40  # 5 MB/s: the 47 MB transfer is in flight for about 9 s
ENV = {"KVFERRY_TRANSFER_TIMEOUT": str(TIMEOUT), "KVFERRY_CHUNK_BYTES": str(1 << 20)}


def _until(sidecar: netns.Sidecar, transfer_id: str, done, limit: float) -> tuple[dict, float]:
    """Poll ``sidecar``'s record of the transfer until ``done(record)``: (record, seconds taken);
    fails the test after ``limit`` seconds with the last record."""
    started, record = time.monotonic(), None
    while time.monotonic() - started < limit:
        try:
            record = sidecar.client.transfer(transfer_id)
        except errors.NotFound:  # not announced there yet
            record = None
        if record is not None and done(record):
            return record, time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"after {limit:g} s the transfer is still {record}; log: {sidecar.log_tail()}")


def _flowing(sidecar: netns.Sidecar, transfer_id: str) -> None:
    """Wait until the receiver has written a few blocks of the transfer."""
    _until(sidecar, transfer_id, lambda r: r["state"] == "running" and r["blocks_done"] >= 5, 60)


def _ended(record: dict) -> bool:
    return record["state"] not in ("queued", "running")


def _big(net: netns.Network, kv):
    """Sidecars on a and b, the cable shaped to RATE_MBIT; a holds 240 blocks (47 MB) of real KV,
    b a region for them."""
    return on_a_cable(net, kv, RATE_MBIT, ENV)


def _next_is_done(sender: netns.Sidecar, receiver: netns.Sidecar, kv, region: str = "dst") -> None:
    """Four blocks to blocks 7, 5, 3, 1 of ``region``: done, and there bit for bit."""
    ids = [7, 5, 3, 1]
    record = sender.client.wait(sender.client.submit("src", range(4), receiver.data_address, region, ids,
                                                     codec="raw"), timeout=60)
    assert record["state"] == "done", record
    over_the_wire(record)
    assert same_bits(blocks_of(receiver, region, ids, kv.shape[1:]), kv[:4])


def test_a_partition_longer_than_the_timeout_fails_the_transfer_and_the_next_one_is_done(networks, kv):
    net = networks("a", "b")
    a, b, big = _big(net, kv)
    transfer = a.client.submit("src", range(big.shape[0]), b.data_address, "dst", range(big.shape[0]), codec="raw")
    _flowing(b, transfer)
    net.cut("a")
    out, took = _until(a, transfer, _ended, TIMEOUT + SLACK + 30)
    assert out["state"] == "failed" and out["error"], out
    assert took < TIMEOUT + SLACK, f"the sender failed it {took:.1f} s after the cut: {out}"
    incoming, _ = _until(b, transfer, _ended, TIMEOUT + SLACK)  # its DONE or CANCEL cannot come: its own deadline
    assert incoming["state"] == "failed" and incoming["error"], incoming
    assert incoming["blocks_done"] < big.shape[0]
    time.sleep(max(0.0, TIMEOUT - took))  # the partition outlasts the timeout, however fast the failure came
    net.heal("a")
    _next_is_done(a, b, kv)


def test_a_peer_unreachable_from_the_start_fails_the_transfer_then_is_reached(networks, kv):
    """The receiver's link is down before the sender ever dialled it: the dial gets no answer at
    all (no reset, no refusal), the transfer fails within its timeouts instead of waiting on TCP's
    own minutes of SYN retries, and once the link is back the next transfer is done."""
    net = networks("a", "b")
    net.shape_all(1000)
    a, b = net.sidecar("a", ENV), net.sidecar("b", ENV)
    a.client.region_from_tensor("src", kv[:4])
    b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
    net.cut("b")
    transfer = a.client.submit("src", range(4), b.data_address, "dst", range(4), codec="raw")
    out, took = _until(a, transfer, _ended, TIMEOUT + SLACK + 30)
    assert out["state"] == "failed" and out["error"], out
    assert took < TIMEOUT + SLACK, f"the sender failed it {took:.1f} s after the submit: {out}"
    net.heal("b")
    _next_is_done(a, b, kv)


def _restart_receiver(net: netns.Network, kv, seen: bool):
    """a has moved KV to b (so it pools a connection to b); then b is killed and started again on
    the same address. ``seen``: over a live link, so b's kernel resets the pooled connection;
    else while b is cut off, so a's pooled connection looks alive until it is used after the link
    returns (a host that rebooted while unreachable)."""
    net.shape_all(1000)
    a, b = net.sidecar("a", ENV), net.sidecar("b", ENV)
    a.client.region_from_tensor("src", kv)
    b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
    _next_is_done(a, b, kv)
    if not seen:
        net.cut("b")
    b.kill()
    if not seen:  # its kernel forgets the connection too, as a reboot would (its FIN would get through)
        net.forget_connections("b")
    b = net.sidecar("b", ENV)  # the same host and address, a new process
    b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
    if not seen:
        net.heal("b")
    return a, b


@pytest.mark.parametrize("seen", [True, False], ids=["reset", "unseen"])
def test_a_restarted_receiver_is_dialled_again(networks, kv, seen):
    a, b = _restart_receiver(networks("a", "b"), kv, seen)
    _next_is_done(a, b, kv)


def test_a_receiver_restarted_unseen_costs_no_transfer(networks, kv):
    """The first transfer after a restart the sender did not see goes out on the pooled
    connection, which the new process's kernel resets before the peer said anything of it: it
    is sent again on a fresh connection and done, with the bytes where they belong."""
    a, b = _restart_receiver(networks("a", "b"), kv, seen=False)
    first = a.client.submit("src", range(4), b.data_address, "dst", range(4), codec="raw")
    record, _ = _until(a, first, _ended, TIMEOUT + SLACK)
    assert record["state"] == "done", record
    _next_is_done(a, b, kv)


@pytest.mark.parametrize("goodbye", [True, False], ids=["reset", "silent"])
def test_a_sender_killed_mid_transfer_fails_the_receiver_within_its_timeout(networks, kv, goodbye):
    """``reset``: the sender's kernel closes its connection; ``silent``: its host is cut off
    first, so nothing ever arrives and only the receiver's own deadline ends the transfer. Either
    way the receiver fails it, frees the region and serves the next sender."""
    net = networks("a", "b")
    a, b, big = _big(net, kv)
    transfer = a.client.submit("src", range(big.shape[0]), b.data_address, "dst", range(big.shape[0]), codec="raw")
    _flowing(b, transfer)
    if not goodbye:
        net.cut("a")
    a.kill()
    incoming, took = _until(b, transfer, _ended, TIMEOUT + SLACK + 30)
    assert incoming["state"] == "failed" and incoming["error"], incoming
    assert took < TIMEOUT + SLACK, f"the receiver failed it {took:.1f} s after the kill: {incoming}"
    assert incoming["blocks_done"] < big.shape[0]
    b.client.delete_region("dst")  # released
    b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
    if not goodbye:
        net.heal("a")
    a = net.sidecar("a", ENV)
    a.client.region_from_tensor("src", kv[:4])
    _next_is_done(a, b, kv)


@pytest.mark.parametrize("stalled", ["sender", "receiver"])
def test_a_peer_stalled_past_the_timeout_fails_the_transfer_on_both_sides(networks, kv, stalled):
    """A sidecar stopped mid-transfer (SIGSTOP: its connections open, nothing read or sent) for
    longer than ``transfer_timeout``: the other side fails the transfer within its timeout. Once
    resumed, the stalled side ends it too, never done: failed by its own timeout, or cancelled by
    the sender's word that it gave up (a resumed receiver first reads the bytes that were waiting
    for it, which are progress); neither daemon logs an error, and the next transfer is done."""
    net = networks("a", "b")
    a, b, big = _big(net, kv)
    codec = "splitzip" if stalled == "sender" else "raw"  # a sender stalled between codec work and its sends
    transfer = a.client.submit("src", range(big.shape[0]), b.data_address, "dst", range(big.shape[0]), codec=codec)
    _flowing(b, transfer)
    frozen, live = (a, b) if stalled == "sender" else (b, a)
    frozen.stall()
    try:
        record, took = _until(live, transfer, _ended, TIMEOUT + SLACK + 30)
    finally:
        frozen.resume()
    assert record["state"] == "failed" and record["error"], record
    assert took < TIMEOUT + SLACK, f"failed {took:.1f} s after the stall: {record}"
    record, _ = _until(frozen, transfer, _ended, TIMEOUT + SLACK)
    assert record["state"] in ("failed", "cancelled") and record["error"], record
    _next_is_done(a, b, kv)
    for sidecar in (a, b):
        assert " ERROR " not in sidecar.log.read_text(errors="replace"), sidecar.log_tail()
