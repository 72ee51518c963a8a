"""Load with the SDK's defaults: 200 concurrent transfers all finish
(over the 64 a sidecar runs at once, the SDK retries its 429s), and the daemon's memory stays flat
over 10,000 transfers once its bounded history is full."""

from __future__ import annotations

import concurrent.futures

import pytest

from kvferry.client import Client
from tests.engine.conftest import TOKEN, spawn, stop

pytestmark = pytest.mark.slow


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_200_concurrent_transfers_and_flat_memory():
    a, b = spawn("tcp"), spawn("tcp")
    try:
        a.client.create_region("src", 8, [2048], "bfloat16")
        b.client.create_region("dst", 8, [2048], "bfloat16")

        def one(i: int) -> str:
            with Client(a.url, token=TOKEN) as c:
                return c.wait(c.submit("src", [i % 8], b.data, "dst", [(i * 3) % 8], codec="raw"), timeout=120)["state"]

        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            assert list(pool.map(one, range(200))) == ["done"] * 200

        def burst(n: int) -> None:
            for i in range(n):
                a.client.submit("src", [i % 8], b.data, "dst", [i % 8], codec="raw", wait=10)

        burst(5000)  # the history (4,096 finished transfers) is full from here on
        before = _rss_mb(a.process.pid), _rss_mb(b.process.pid)
        burst(5000)
        after = _rss_mb(a.process.pid), _rss_mb(b.process.pid)
        assert all(later - earlier < 25 for earlier, later in zip(before, after)), (before, after)
        assert len(a.client.transfers()) == 1000  # the listing's default page; the table holds 4,096
    finally:
        stop(a, b)
