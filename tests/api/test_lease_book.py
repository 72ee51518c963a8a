"""The sidecar's lease book beside a real engine: a lease ends with its region however the region
is deleted, a lease renewed while another one's delete waited is not deleted with the stale list,
no lease is taken of a region being deleted, and the book closes at once (a sidecar's shutdown)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvferry.api.leases import LeaseBook
from kvferry.engine import Engine, RegionSpec, Settings
from kvferry.engine.errors import Conflict, NotFound


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(body):
    async def main():
        engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp"))
        await engine.start()
        clock = Clock()
        book = LeaseBook(clock)
        book.start(engine)
        try:
            for name in ("a", "l", "cache"):
                await engine.register_region(RegionSpec(name, 4, (64,), "bfloat16"))
            await body(engine, book, clock)
        finally:
            started = time.monotonic()
            async with asyncio.timeout(10):
                await book.close()
            closed_in = time.monotonic() - started
            await engine.close()
        assert closed_in < 5, closed_in  # its expiry task stops, even woken by a lease that just ended

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_region_deleted_by_any_front_end_ends_its_lease():
    async def body(engine, book, clock):
        book.take(engine, "req", 60, None, of="cache")
        generation = book.generation
        await engine.delete_region("req")  # as the gRPC front end deletes: straight through the engine
        assert "req" not in book.leases
        assert book.generation > generation  # the prefill's long-poll hears of it

    _run(body)


def test_a_lease_renewed_while_another_expired_ones_delete_waits_is_kept(monkeypatch):
    async def body(engine, book, clock):
        gate = asyncio.Event()
        delete = engine.delete_region

        async def slow_for_a(name, *args, **kwargs):
            if name == "a":  # as a delete waiting for a sender's REVOKED
                await gate.wait()
            await delete(name, *args, **kwargs)

        monkeypatch.setattr(engine, "delete_region", slow_for_a)
        book.take(engine, "a", 1, None)
        book.take(engine, "l", 1, None)
        clock.now = 2.0  # both expired
        book._bump()  # wake the expiry task now
        await asyncio.sleep(0.1)
        assert book.renew(["l"], 60) == {"renewed": ["l"], "missing": []}
        gate.set()
        await asyncio.sleep(0.2)
        with pytest.raises(NotFound):
            engine.regions.get("a")
        assert engine.regions.get("l") is not None and "l" in book.leases

    _run(body)


def test_no_lease_is_taken_of_a_region_being_deleted(monkeypatch):
    async def body(engine, book, clock):
        region = engine.regions.get("cache")
        region.deleting += 1  # a delete under way (waiting for a sender, say)
        with pytest.raises(Conflict, match="being deleted"):
            book.take(engine, "cache", 60, None)
        with pytest.raises(Conflict, match="being deleted"):
            book.take(engine, "req", 60, None, of="cache")
        region.deleting -= 1
        assert book.take(engine, "req", 60, None, of="cache")["name"] == "req"

    _run(body)
