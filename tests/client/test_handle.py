"""The typed transfer handle (``Client.start``, ``AsyncClient.start``) against real sidecars."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from kvferry.client import AsyncClient, AsyncTransfer, Transfer, TransferFailed, TransferStatus
from kvferry.engine import errors
from tests.client.conftest import TOKEN


def _name() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


def _regions(a, b, blocks: int = 4) -> tuple[str, str, torch.Tensor]:
    src, dst = _name(), _name()
    kv = torch.randn(blocks, 2, 8, 64).to(torch.bfloat16)
    a.client.region_from_tensor(src, kv)
    b.client.create_region(dst, blocks, [2, 8, 64], "bfloat16")
    return src, dst, kv


def test_a_status_parses_the_transfer_json():
    first = TransferStatus.from_record({"id": "t1", "state": "queued"})
    assert (first.id, first.state, first.terminal, first.ratio, first.stages) == ("t1", "queued", False, None, {})
    record = {"id": "t1", "state": "done", "bytes_raw": 10, "bytes_wire": 5, "ratio": 2.0, "stages": {"done": 0.1},
              "error": None, "error_kind": None, "a_field_of_a_newer_sidecar": 1}
    done = TransferStatus.from_record(record)
    assert done.ok and done.terminal and done.ratio == 2.0 and done.stages == {"done": 0.1}
    assert done.record["a_field_of_a_newer_sidecar"] == 1
    with pytest.raises(AttributeError):
        done.state = "failed"  # frozen


def test_start_gives_a_handle_that_waits_and_reports(sidecars):
    a, b = sidecars
    src, dst, kv = _regions(a, b)
    t = a.client.start(src, [0, 1, 2, 3], b.data, dst, [3, 2, 1, 0], codec="raw")
    assert isinstance(t, Transfer) and t.id and t.status.id == t.id
    status = t.wait(timeout=30)
    assert status.ok and t.done and t.status is status
    assert status.bytes_raw == kv.numel() * 2 and status.chosen_codec == "raw" and status.direction == "out"
    assert b.client.get_block(dst, 3) == kv[0].view(torch.uint8).numpy().tobytes()
    again = a.client.handle(t.id)
    assert again.status == status and again.done
    assert a.client.wait(t.id)["state"] == "done"  # the old call, a dict as before
    with pytest.raises(errors.Conflict):
        t.cancel()


def test_a_failed_transfer_raises_and_keeps_its_status(sidecars):
    a, b = sidecars
    src, _, _ = _regions(a, b)
    t = a.client.start(src, [0], b.data, "no-such-region", [0])
    with pytest.raises(TransferFailed, match="NotFound") as failed:
        t.wait(timeout=30)
    assert failed.value.state == "failed" and failed.value.kind == "PeerError"  # the receiver refused it
    assert t.done and t.status.state == "failed" and t.status.error_kind == "PeerError"
    with pytest.raises(errors.NotFound):
        a.client.handle("no-such-transfer")


def test_the_async_client_starts_and_awaits_a_handle(sidecars):
    a, b = sidecars
    src, dst, _ = _regions(a, b)

    async def main() -> None:
        async with AsyncClient(a.url, token=TOKEN) as client:
            t = await client.start(src, range(4), b.data, dst, range(4))
            assert isinstance(t, AsyncTransfer)
            status = await t.wait(timeout=30)
            assert status.ok and t.done and (await client.wait(t.id))["state"] == "done"
            assert (await client.handle(t.id)).status.id == t.id
            with pytest.raises(errors.Conflict):
                await t.cancel()

    asyncio.run(main())
