"""A sender writing into more GPU regions of same-host receivers than it keeps mapped beyond its
leases: every region lent stays mapped while its lease stands, each opened once however many
transfers write into it (opening a handle takes milliseconds, and unmapping one that a write on
another thread is copying into faults the GPU), and let go with its lease. Skipped without CUDA
and CuPy."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry.engine import ipc
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ipc.available(), reason="needs a CUDA GPU and CuPy")]

REGIONS = 72  # more than the mappings kept beyond leases (``ipc._OPEN_LIMIT``)
BLOCKS, BLOCK = 12, (512, 1024)  # 12 MiB of bf16 a region: an allocation (a CUDA IPC handle) of its own


def _sample(text: str, name: str) -> float:
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _filled(device: str) -> torch.Tensor:
    """A region's memory, allocated alone (no temporary on the GPU that a later one could be cut from)."""
    region = torch.empty((BLOCKS, *BLOCK), dtype=torch.bfloat16, device=device)
    region.copy_(torch.randn((BLOCKS, *BLOCK)).to(torch.bfloat16))
    return region


def test_more_leased_regions_than_the_map_keeps_are_each_opened_once_and_let_go_with_their_lease():
    assert REGIONS > ipc._OPEN_LIMIT
    last = f"cuda:{torch.cuda.device_count() - 1}"  # the other GPU where there are two
    env = {"KVFERRY_TRANSFER_TIMEOUT": "60"}
    sender, receiver = spawn("tcp", env, device="cuda:0"), spawn("tcp", env, device=last)
    try:
        sources = [_filled("cuda:0") for _ in range(REGIONS)]
        targets = [torch.zeros((BLOCKS, *BLOCK), dtype=torch.bfloat16, device=last) for _ in range(REGIONS)]
        for i, (source, target) in enumerate(zip(sources, targets)):
            sender.client.region_from_tensor(f"s{i}", source, kind="cuda_ipc")
            receiver.client.region_from_tensor(f"d{i}", target, kind="cuda_ipc")
        pairs = [(f"s{i}", f"d{i}") for i in range(REGIONS)]
        src_ids, dst_ids = [0, 5, 11], [7, 1, 3]
        for round_ in range(4):
            if round_:
                for source in sources:
                    source.copy_(torch.randn((BLOCKS, *BLOCK)).to(torch.bfloat16))
                torch.cuda.synchronize()
            tid = sender.client.submit_regions(pairs, src_ids, receiver.data, dst_ids, codec="raw")
            record = sender.client.wait(tid, timeout=120)
            assert record["state"] == "done", record
            assert "same host" in record["choice_reason"], record  # written into the lent memory
            torch.cuda.synchronize()
            for source, target in zip(sources, targets):
                assert bits_equal(target[dst_ids].cpu(), source[src_ids].cpu())
                untouched = [i for i in range(BLOCKS) if i not in dst_ids]
                assert not target[untouched].any()
        metrics = sender.client.metrics()
        assert _sample(metrics, "kvferry_peer_memory_opened_total") == REGIONS  # once each, not once a write
        assert _sample(metrics, "kvferry_peer_memory_mapped") == REGIONS
        receiver.client.delete_region("d0")  # its lease taken back: its memory let go
        assert _sample(sender.client.metrics(), "kvferry_peer_memory_mapped") == REGIONS - 1
    finally:
        stop(sender, receiver)
