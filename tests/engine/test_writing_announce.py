"""A same-host write announced while it runs (an ANNOUNCE flagged WRITING, with the CUDA event that
ends it), from the receiver's side, driven by hand over a real connection: a receiver that cannot
open the event (here: host memory, which no GPU event ends; on a host, a handle the driver
refuses) answers with an empty ACCEPT and is done only once the sender's WRITTEN comes; a sender that never says it fails the
transfer in time; such an announce is refused without a lease, or for a codec other than raw. With
the driver's event stood in for: the receiver says DONE only once the event is reached, takes no
WRITTEN meanwhile, and does not retry a handle the driver refused for that peer. Host shared
memory stands in for the lent GPU memory (the receiver's path is the same past the event)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from multiprocessing import shared_memory

import pytest
import torch

from kvferry.engine import Engine, RegionSpec, Settings, ipc, peer
from kvferry.engine.blocks import Blocks
from kvferry.transport.wire import MessageType
from tests.rawpeer import RawPeer

SECRET = "writing-announce"
BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 400  # more than rides inline: the first transfer offers to write itself


def _announce(transfer_id: str, ids: list[int], flags: int = 0, codec: str = "raw") -> peer.Message:
    writing = flags & peer.FLAG_WRITING
    return peer.Message(transfer_id, peer.Announce(
        codec, "bfloat16", Blocks(ids=tuple(ids)), (peer.PairLayout("dst", BLOCK, 64),), host=ipc.host_id(),
        flags=flags, event=bytes(range(64)) if writing else b"", event_gpu=bytes([7] * 16) if writing else b""))


async def _reply(raw: RawPeer, timeout: float = 5) -> peer.Message:
    """The next peer message (CTS and other transport messages skipped)."""
    while True:
        message, payload = await asyncio.wait_for(raw.recv(), timeout)
        if message.type == MessageType.MSG:
            return peer.unpack(payload)


def _run(body, transfer_timeout: float = 10):
    async def main():
        engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", peer_secret=SECRET,
                                 transfer_timeout=transfer_timeout))
        await engine.start()
        segment = shared_memory.SharedMemory(name=f"kvferry-w{uuid.uuid4().hex[:12]}", create=True,
                                             size=BLOCKS * BLOCK[0] * 2)
        raw = None
        try:
            await engine.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm",
                                                    shm_name=segment.name))
            view = torch.frombuffer(segment.buf, dtype=torch.int16).view(BLOCKS, *BLOCK)
            raw = await RawPeer.connect(engine.data_address, SECRET.encode())
            await body(engine, raw, view)
        finally:
            if raw is not None:
                await raw.close()
            await engine.close()
            del view
            segment.close()
            segment.unlink()

    asyncio.run(asyncio.wait_for(main(), 60))


async def _lease(raw: RawPeer, view: torch.Tensor) -> None:
    """Take the lease as a sender does: offer to write, be lent the region, write, say WRITTEN."""
    first = uuid.uuid4().hex
    await raw.send_peer(_announce(first, list(range(300))))
    accept = await _reply(raw)
    assert isinstance(accept.body, peer.Accept) and accept.body.targets, accept
    assert accept.body.targets[0].device_uuid == peer.HOST_MEMORY
    view[:300] = 1
    await raw.send_peer(peer.Message(first, peer.Written(300)))
    done = await _reply(raw)
    assert isinstance(done.body, peer.Done) and done.transfer_id == first


async def _state(engine: Engine, transfer_id: str, timeout: float = 5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        record = engine.status(transfer_id)
        if record["state"] != "running" or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.01)


def test_a_receiver_that_cannot_open_the_event_asks_for_written_and_is_done_only_then():
    async def body(engine, raw, view):
        await _lease(raw, view)
        transfer_id, ids = uuid.uuid4().hex, [5, 9, 100]
        await raw.send_peer(_announce(transfer_id, ids, peer.FLAG_WRITING))
        asked = await _reply(raw)
        assert asked.transfer_id == transfer_id and asked.body == peer.Accept(), asked  # no targets: say WRITTEN
        await asyncio.sleep(0.2)
        assert engine.status(transfer_id)["state"] == "running"  # the event alone does not end it here
        view[ids] = 3
        await raw.send_peer(peer.Message(transfer_id, peer.Written(len(ids))))
        done = await _reply(raw)
        assert isinstance(done.body, peer.Done) and done.transfer_id == transfer_id and done.body.blocks == len(ids)
        record = await _state(engine, transfer_id)
        assert record["state"] == "done" and record["blocks_done"] == len(ids), record

    _run(body)


def test_a_sender_that_never_says_written_fails_the_transfer_in_time():
    async def body(engine, raw, view):
        await _lease(raw, view)
        transfer_id = uuid.uuid4().hex
        started = time.monotonic()
        await raw.send_peer(_announce(transfer_id, [1, 2], peer.FLAG_WRITING))
        assert (await _reply(raw)).body == peer.Accept()
        error = await _reply(raw, timeout=10)
        assert isinstance(error.body, peer.Error) and "did not write" in error.body.reason, error
        assert time.monotonic() - started < 5
        assert (await _state(engine, transfer_id))["state"] == "failed"
        assert not engine.links and not engine.transfers.active()

    _run(body, transfer_timeout=1.5)


@pytest.mark.parametrize("case", ["no lease", "not raw"])
def test_a_writing_announce_is_refused_without_a_lease_or_for_a_codec(case):
    async def body(engine, raw, view):
        if case == "not raw":
            await _lease(raw, view)
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(_announce(transfer_id, [1], peer.FLAG_WRITING,
                                      codec="splitzip" if case == "not raw" else "raw"))
        reply = await _reply(raw)
        assert isinstance(reply.body, peer.Reject) and reply.body.error == "ProtocolViolation", reply
        assert engine.transfers.find(transfer_id) is None

    _run(body)


class _Opened:
    """The driver's view of a peer's event, stood in for (no GPU here): reached when told."""

    reached = False
    devices: list[int] = []  # where each was opened

    def __init__(self, handle: bytes):
        self.handle = handle

    def query(self) -> bool:
        return _Opened.reached


@pytest.fixture
def stand_in_events(monkeypatch) -> list[bytes]:
    """Peers' events open here as ``_Opened`` (the handles opened are listed); a handle of all
    0xff bytes is refused, as the driver refuses a junk one."""
    opened: list[bytes] = []

    def from_ipc_handle(cls, device, handle):
        if handle == b"\xff" * 64:
            raise RuntimeError("invalid resource handle")
        opened.append(handle)
        _Opened.devices.append(device)
        return _Opened(handle)

    _Opened.reached, _Opened.devices = False, []
    monkeypatch.setattr(ipc, "available", lambda: True)
    # The shared memory stands for GPU 5's: the event is opened where the write lands.
    monkeypatch.setattr(ipc, "event_device", lambda memory: 5 if memory.type == "cpu" else None)
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", classmethod(from_ipc_handle))
    return opened


def test_a_receiver_says_done_only_once_the_senders_event_is_reached(stand_in_events):
    async def body(engine, raw, view):
        await _lease(raw, view)
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(_announce(transfer_id, [4, 8], peer.FLAG_WRITING))
        with pytest.raises(TimeoutError):  # no ACCEPT (it waits on the event), and no DONE yet
            await _reply(raw, timeout=0.5)
        assert stand_in_events == [bytes(range(64))] and engine.status(transfer_id)["state"] == "running"
        assert _Opened.devices == [5]  # in the context of the GPU the write lands on, not the sender's
        _Opened.reached = True
        done = await _reply(raw)
        assert isinstance(done.body, peer.Done) and done.transfer_id == transfer_id and done.body.blocks == 2
        assert (await _state(engine, transfer_id))["state"] == "done"
        reached = uuid.uuid4().hex  # reached before its announce is read: done at once, the event kept
        await raw.send_peer(_announce(reached, [3], peer.FLAG_WRITING))
        done = await _reply(raw)
        assert isinstance(done.body, peer.Done) and done.transfer_id == reached
        assert stand_in_events == [bytes(range(64))] and not engine.links

    _run(body)


def test_a_written_for_a_transfer_that_waits_on_its_event_breaks_the_protocol(stand_in_events):
    async def body(engine, raw, view):
        await _lease(raw, view)
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(_announce(transfer_id, [4], peer.FLAG_WRITING))
        await raw.send_peer(peer.Message(transfer_id, peer.Written(1)))  # only the event may say so
        error = await _reply(raw)
        assert isinstance(error.body, peer.Error) and error.body.error == "ProtocolViolation", error
        assert (await _state(engine, transfer_id))["state"] == "failed"

    _run(body)


def test_a_refused_event_handle_is_not_tried_again_for_that_peer(stand_in_events):
    async def body(engine, raw, view):
        await _lease(raw, view)
        for i in range(3):
            transfer_id = uuid.uuid4().hex
            announce = _announce(transfer_id, [i], peer.FLAG_WRITING)
            junk = peer.Message(transfer_id, dataclasses.replace(announce.body, event=b"\xff" * 64))
            await raw.send_peer(junk if i == 0 else announce)  # later ones open, but not for this peer
            assert (await _reply(raw)).body == peer.Accept()  # say WRITTEN
            await raw.send_peer(peer.Message(transfer_id, peer.Written(1)))
            assert isinstance((await _reply(raw)).body, peer.Done)
        assert stand_in_events == []

    _run(body)


def test_opened_events_are_kept_per_connection_bounded_and_let_go_with_it(stand_in_events):
    """The receiver's cache of opened events: a handle is opened once per connection, at most
    ``OPEN_LIMIT`` are kept, and a connection's are let go when it is."""
    opened = stand_in_events
    events, gpu = ipc.WriteEvents(), bytes(16)
    a, b = object(), object()
    first = events.open(b"h1", gpu, 0, a)
    assert first is not None and not first.ready() and events.open(b"h1", gpu, 0, a) is first and opened == [b"h1"]
    assert events.open(b"h1", gpu, 0, b) is not first and opened == [b"h1", b"h1"]  # another connection's
    for i in range(events.OPEN_LIMIT):
        events.open(b"n%d" % i, gpu, 0, b)
    assert len(events._opened) == events.OPEN_LIMIT and b"h1" not in events._opened  # the oldest went
    events.open(b"mine", gpu, 0, a)
    events.forget(b)
    assert list(events._opened) == [b"mine"]
