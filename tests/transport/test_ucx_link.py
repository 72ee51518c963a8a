"""The UCX link's posted sends: small host parts leave at once, in the order given, as copies."""

from __future__ import annotations

import asyncio

import numpy as np

from kvferry.transport import ucx

from .conftest import config, run


def test_small_parts_are_posted_at_once_in_order_as_copies():
    async def body():
        cfg = config("ucxx")
        accepted: asyncio.Queue = asyncio.Queue()
        finished = asyncio.Event()

        async def on_link(link):
            await accepted.put(link)
            await finished.wait()  # the far end lives until the test is done

        listener = await ucx.listen("127.0.0.1", 0, on_link, cfg)
        near = await ucx.connect("127.0.0.1", listener.port, cfg)
        far = await asyncio.wait_for(accepted.get(), 10)
        header, small = b"h" * 80, bytearray(b"a" * 100)
        large = memoryview(np.arange(ucx._POST_NOW_BYTES + 1, dtype=np.uint64).view(np.uint8))
        parts = [header, memoryview(small), large, b"t" * 80]
        rest = near.send_now(parts)
        assert rest == parts[2:]  # posted up to the first part too large to post
        sent_small = bytes(small)
        small[:] = b"z" * 100  # the caller may reuse its buffer once send_now returns
        sending = asyncio.ensure_future(near.send_rest(rest))  # a large send completes once it is received
        got_header = await far.recv_header(80)
        got = [bytearray(len(small)), bytearray(large.nbytes), bytearray(80)]
        for buffer in got:
            await far.recv_payload(memoryview(buffer))
        await asyncio.wait_for(sending, 10)
        assert got_header == header and bytes(got[0]) == sent_small
        assert bytes(got[1]) == large.tobytes() and bytes(got[2]) == b"t" * 80
        finished.set()
        await near.close()
        await far.close()
        await listener.close()

    run(body())


def test_a_peer_that_stops_reading_gets_awaited_sends_not_a_growing_backlog(monkeypatch):
    monkeypatch.setattr(ucx, "_POST_NOW_PENDING", 2)

    class Request:
        completed = False

    class Endpoint:  # a UCX endpoint whose sends never complete (the peer reads nothing)
        _tags = {"msg_send": 7}

        class _ep:
            @staticmethod
            def raise_on_error():
                pass

            @staticmethod
            def tag_send(buffer, tag):
                return Request()

        class _ctx:
            class worker:
                @staticmethod
                def progress():
                    pass

    link = ucx.UcxLink(Endpoint(), "p")
    parts = [b"a" * 80, b"b" * 80, b"c" * 80]
    assert link.send_now(parts) == parts[2:]
    assert link.send_now([b"d" * 80]) == [b"d" * 80]  # still two uncompleted: nothing more is posted


def test_a_progress_thread_s_worker_is_never_progressed_from_the_loop():
    assert ucx._owns_worker(config("ucxx", ucx_progress_mode="blocking"))
    assert not ucx._owns_worker(config("ucxx", ucx_progress_mode="thread"))
    link = ucx.UcxLink(endpoint=None, peer="p", post_now=False)
    parts = [b"h" * 80]
    assert link.send_now(parts) == parts  # left for send_rest, which awaits ucxx's own sends
