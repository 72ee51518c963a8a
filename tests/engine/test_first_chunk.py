"""The first streamed chunk's payload is in its link's hands before the next chunk's encode
starts: on a link slower than the codec its bytes are the pipeline's whole fill, and a GPU encode
launched meanwhile would hold its checksum and its lanes back. Two real engines over TCP on
loopback, in one process; a send that waits before it writes (on a GPU, for its checksum) is
stood in for by a short sleep."""

from __future__ import annotations

import asyncio

import torch

from kvferry import transport
from kvferry.engine import streaming
from kvferry.transport.wire import MessageType
from tests.engine.test_abort_points import BLOCKS, _run, _spec


def test_the_next_encode_waits_until_the_first_chunk_is_being_written(monkeypatch):
    order: list[tuple[str, int]] = []
    send, write_many, encode = transport.Connection.send, transport.Connection._write_many, streaming.Chunks.encode

    async def checked_late(self, tag, payload, **kwargs):
        await asyncio.sleep(0.02)  # the payload's checksum still on the GPU
        return await send(self, tag, payload, **kwargs)

    async def noted_write(self, messages):
        order.extend(("data", m.tag) for m, _ in messages if m.type == MessageType.DATA and m.offset == 0)
        return await write_many(self, messages)

    async def noted_encode(self, t, codec, pair, start, count, index):
        order.append(("encode", index))
        return await encode(self, t, codec, pair, start, count, index)

    monkeypatch.setattr(transport.Connection, "send", checked_late)
    monkeypatch.setattr(transport.Connection, "_write_many", noted_write)
    monkeypatch.setattr(streaming.Chunks, "encode", noted_encode)

    async def body(a, b):
        ids = list(range(BLOCKS))
        record = await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 20)
        assert record["state"] == "done"
        assert torch.equal(b.regions.get("dst").tensor[ids[::-1]], a.regions.get("src").tensor[ids])
        kinds = [kind for kind, _ in order]
        assert kinds.count("data") >= 3 and kinds.count("encode") == kinds.count("data"), order
        assert kinds[:3] == ["encode", "data", "encode"], order  # the first DATA before the second encode

    _run(body, chunk_bytes=1 << 20)  # 1 MiB chunks (none inline): seven
