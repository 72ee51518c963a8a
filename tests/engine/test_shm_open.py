"""A worker's shared-memory segment that fails to open here is left as it was. Python's
``SharedMemory(name, create=False)`` unlinks the name when mapping it fails after it opened (a
process one descriptor short of its limit: ``mmap`` duplicates the descriptor), which would delete
a segment the worker owns: a receiver registering it, or a same-host sender writing into it."""

from __future__ import annotations

import os
import resource
import uuid
from contextlib import contextmanager
from multiprocessing import shared_memory

import pytest
import torch

from kvferry.engine import errors, ipc, regions


@contextmanager
def _one_descriptor_left():
    """Only the lowest free descriptor may be opened: the segment opens, its mapping's duplicate does not."""
    lowest = os.dup(0)
    os.close(lowest)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + 1, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(name=f"kvferry-t{uuid.uuid4().hex[:12]}", create=True, size=1 << 16)
    yield shm
    shm.close()
    shm.unlink()


def _exists(shm) -> bool:
    return os.path.exists(f"/dev/shm/{shm.name}")


def test_a_segment_that_does_not_map_is_not_unlinked(segment):
    with _one_descriptor_left(), pytest.raises(OSError):
        ipc.open_segment(segment.name)
    assert _exists(segment)
    opened = ipc.open_segment(segment.name)  # and opens once descriptors are there
    opened.buf[:4] = b"kvfe"
    assert bytes(segment.buf[:4]) == b"kvfe" and opened.size == segment.size and opened.name == segment.name
    ipc.close_segment(opened)
    assert _exists(segment)


def test_a_region_that_cannot_map_its_segment_is_refused_and_leaves_it(segment):
    with _one_descriptor_left(), pytest.raises(errors.BadRequest, match="cannot open shared memory"):
        regions._map_shm(segment.name, (4, 8192), torch.bfloat16)
    assert _exists(segment)
    tensor, opened = regions._map_shm(segment.name, (4, 8192), torch.bfloat16)
    del tensor
    ipc.close_segment(opened)
    assert _exists(segment)


def test_a_lent_segment_that_cannot_map_is_refused_and_left(segment):
    from kvferry.engine import peer

    target = peer.Target(segment.name.encode().ljust(peer.HANDLE_BYTES, b"\0"), 0, peer.HOST_MEMORY, 4,
                         peer.segment_id(os.fstat(segment._fd)))
    mapper = ipc.Mapper()
    with _one_descriptor_left(), pytest.raises(RuntimeError, match="cannot open the receiver's shared memory"):
        mapper.tensor(target, (4, 8192), torch.bfloat16)
    assert _exists(segment)
    assert mapper.tensor(target, (4, 8192), torch.bfloat16).shape == (4, 8192)
    mapper.close()
    assert _exists(segment)
