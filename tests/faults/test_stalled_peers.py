"""A sender that drips its chunk a byte at a time, or stops mid-chunk:
the receiving transfer fails within ``transfer_timeout`` with a reason, its region is released,
and the daemon keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from kvferry.engine import errors, peer
from kvferry.engine.blocks import Blocks
from kvferry.transport import tcp
from kvferry.transport.config import TransportConfig
from kvferry.transport.wire import Message, MessageType
from tests.engine.conftest import spawn, stop
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow
SECRET = "drip-test"


async def _announce(address: str, transfer_id: str, elements: int, inline_chunks: int = 0) -> RawPeer:
    """An authenticated link to ``address`` that has announced a one-block raw transfer."""
    link = await RawPeer.connect(address, SECRET.encode())
    await link.send_peer(peer.Message(transfer_id, peer.Announce(
        "raw", "bfloat16", Blocks(ids=(0,)), (peer.PairLayout("dst", (elements,), 1),), inline_chunks=inline_chunks)))
    return link


async def _until_ended(client, transfer_id: str) -> tuple[dict, float]:
    """Poll the receiver's record until it is no longer running: (record, seconds it took)."""
    started = time.monotonic()
    while True:
        try:
            state = await asyncio.to_thread(client.transfer, transfer_id, 1)
        except errors.NotFound:  # not announced yet
            assert time.monotonic() - started < 10
            await asyncio.sleep(0.05)
            continue
        if state["state"] != "running" or time.monotonic() - started > 20:
            return state, time.monotonic() - started


async def _drip(address: str, transfer_id: str, block_bytes: int, stop_after: int | None) -> None:
    """Announce a one-block raw transfer, then send its chunk as one-byte DATA messages, one
    every 0.5 s (each one is progress to the transport), or stop after a few."""
    link = await _announce(address, transfer_id, block_bytes // 2)
    total = block_bytes + 160
    tag = peer.chunk_tag(transfer_id, 0)  # the initial credit's chunk: no CTS to wait for
    sent = 0
    while sent < total and (stop_after is None or sent < stop_after):
        await link.send(Message(MessageType.DATA, tag, sent, 1, total), b"\0")
        sent += 1
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("stop_after", [None, 3], ids=["drips", "stalls"])
def test_a_dripping_or_stalled_sender_fails_within_the_timeout(stop_after):
    b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "3", "KVFERRY_PEER_SECRET": SECRET})
    try:
        b.client.create_region("dst", 2, [512], "bfloat16")
        transfer_id = uuid.uuid4().hex

        async def main():
            sender = asyncio.create_task(_drip(b.data, transfer_id, 1024, stop_after))
            try:
                return await _until_ended(b.client, transfer_id)
            finally:
                sender.cancel()

        state, took = asyncio.run(main())
        assert state["state"] == "failed" and state["error"], state
        assert took < 3 + 3  # the timeout, plus the polling's own second
        b.client.delete_region("dst")  # no longer busy
    finally:
        stop(b)


def test_inline_chunks_that_never_come_fail_the_receiver_within_the_timeout():
    """A small transfer's chunks ride right behind its announce and are decoded as the reader
    takes them (no task waits for them): an announce promising one that never comes still fails."""
    b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "2", "KVFERRY_PEER_SECRET": SECRET})
    try:
        b.client.create_region("dst", 2, [512], "bfloat16")
        transfer_id = uuid.uuid4().hex

        async def main():
            link = await _announce(b.data, transfer_id, 512, inline_chunks=1)
            try:
                return await _until_ended(b.client, transfer_id)
            finally:
                await link.close()

        state, took = asyncio.run(main())
        assert state["state"] == "failed" and "did not come" in state["error"], state
        assert took < 2 + 3
        b.client.delete_region("dst")  # no longer busy
    finally:
        stop(b)


def test_a_receiver_that_never_confirms_an_inline_transfer_fails_it_within_the_timeout():
    """The sender's side of a small transfer ends on the receiver's DONE, which a stalled peer
    never sends: its deadline fails it, and its region is free again."""
    b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "2", "KVFERRY_PEER_SECRET": SECRET})
    try:
        b.client.create_region("src", 2, [512], "bfloat16")

        async def main():
            config = TransportConfig(backend="tcp", secret=SECRET.encode())
            silent = []

            async def take(link):  # authenticates, then reads everything and answers nothing
                silent.append(link)
                raw = await RawPeer.accept(link, config.secret)
                with contextlib.suppress(Exception):
                    while True:
                        await raw.recv()

            listener = await tcp.listen("127.0.0.1", 0, take, config)
            try:
                address = f"127.0.0.1:{listener.port}"
                # The first transfer opens the pooled connection; the second goes inline on it.
                for _ in range(2):
                    transfer = await asyncio.to_thread(b.client.submit, "src", [0], address, "dst", [0], codec="raw")
                    started = time.monotonic()
                    with pytest.raises(errors.TransferFailed, match="did not (confirm|answer the announce)"):
                        await asyncio.to_thread(b.client.wait, transfer, 10)
                    assert time.monotonic() - started < 2 + 2
            finally:
                await listener.close()
                for link in silent:
                    await link.close()

        asyncio.run(main())
        b.client.delete_region("src")  # no longer busy
    finally:
        stop(b)
