"""CUDA payloads over a TCP socket, staged through pinned host memory in slices.

A device payload crosses a socket only through host memory. Copying it whole into pageable
memory, then sending it, serialises the copy with the socket and holds the event loop for both.
Here a worker thread does the payload's socket calls (they release the GIL) while the copy
engine moves the next slice: host ↔ device copies of slice k+1 overlap the socket's work on
slice k, in two pinned buffers per direction. The event loop only waits for the thread.

The payload's authenticity is not checked here: a device payload carries a digest computed and
checked on its GPU (``seal.device_digest``), so no host code touches its bytes.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

from collections.abc import Callable

from . import lanes
from .errors import PeerLost, TransportTimeout

SLICE_BYTES = 4 << 20  # one pinned staging buffer; two per direction per link
Read = Callable[[memoryview], None]  # fills the view from a lane, or raises
Write = Callable[[list], None]  # sends the buffers, in order, on a lane, or raises
Deal = Callable[[], "tuple[int, int] | None"]  # the next (offset, size) this lane carries


class DeviceStaging:
    """The pinned buffers and the copy stream of one link and one direction, created on first
    use (links that never carry a device payload pin nothing)."""

    def __init__(self) -> None:
        self._device: Any = None
        self._buffers: list[Any] = []
        self._events: list[Any] = []
        self._views: list[memoryview] = []
        self._stream: Any = None

    def _ready_for(self, device: Any) -> None:
        import torch

        if self._device == device:
            return
        self._device = device
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)
            self._buffers = [torch.empty(SLICE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            self._views = [memoryview(buffer.numpy()) for buffer in self._buffers]

    def send(self, write: Write, payload: Any, deal: Deal | None = None) -> None:
        """Send the uint8 CUDA tensor ``payload`` (its bytes ready): device → pinned slices →
        ``write``, the copy of each slice launched while the one before it is sent. With
        ``deal`` (a lane's share of a dealt payload), the slices are the ones it deals, each
        behind its header, and an empty one ends them. Runs in a worker thread."""
        import torch

        self._ready_for(payload.device)
        if deal is None:
            n = payload.numel()
            spans = iter([(offset, min(SLICE_BYTES, n - offset)) for offset in range(0, n, SLICE_BYTES)])
            take = lambda: next(spans, None)  # noqa: E731
        else:
            take = deal
        with torch.cuda.device(payload.device), torch.cuda.stream(self._stream):
            k, span = 0, take()
            if span is not None:
                self._copy_out(payload, span, 0)
            while span is not None:
                following = take()
                if following is not None:
                    self._copy_out(payload, following, (k + 1) % 2)
                self._events[k % 2].synchronize()
                body = self._views[k % 2][:span[1]]
                write([lanes.slice_header(*span), body] if deal is not None else [body])
                k, span = k + 1, following
            if deal is not None:
                write([lanes.slice_header(0, 0)])

    def _copy_out(self, payload: Any, span: tuple[int, int], b: int) -> None:
        offset, size = span
        if size > SLICE_BYTES:
            raise ValueError(f"a {size}-byte slice does not fit a {SLICE_BYTES}-byte staging buffer")
        self._buffers[b][:size].copy_(payload[offset:offset + size], non_blocking=True)
        self._events[b].record(self._stream)

    def recv(self, read: Read, region: Any, tally: lanes.Tally | None = None) -> None:
        """Fill the uint8 CUDA tensor ``region`` from ``read``: read → pinned slice → device, the
        copy of each slice running while the next one is read. With ``tally`` (a lane's share of
        a dealt payload), slices come behind their headers until an empty one, each admitted by
        the tally first. Returns once every byte read is in ``region``. Runs in a worker thread."""
        import torch

        self._ready_for(region.device)
        pending = [False, False]
        k = 0
        with torch.cuda.device(region.device), torch.cuda.stream(self._stream):
            for start, size in lanes.arriving(read, tally, region.numel()):
                for offset in range(start, start + size, SLICE_BYTES):  # a peer's slice may be any size
                    piece, b = min(SLICE_BYTES, start + size - offset), k % 2
                    if pending[b]:
                        self._events[b].synchronize()  # its previous slice has left the buffer
                    read(self._views[b][:piece])
                    region[offset:offset + piece].copy_(self._buffers[b][:piece], non_blocking=True)
                    self._events[b].record(self._stream)
                    pending[b] = True
                    k += 1
            self._stream.synchronize()


def _send_parts(sock: socket.socket, parts: list[Any], timeout: float) -> None:
    """Send ``parts`` in order with as few ``sendmsg`` calls as the socket takes them in (a
    slice's header and its bytes leave in one segment train), giving up after ``timeout``
    seconds without progress."""
    parts = [memoryview(part).cast("B") for part in parts]
    while parts:
        try:
            sent = sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            _wait(sock, select.POLLOUT, timeout, "send")
            continue
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:
            parts[0] = parts[0][sent:]


def _recv_all(sock: socket.socket, view: memoryview, timeout: float) -> None:
    """Fill ``view`` from a worker thread. ``MSG_WAITALL`` lets a blocking lane socket fill a
    whole slice in one call (one GIL round trip where a non-blocking read takes what has
    arrived, often 64 KiB); on a non-blocking socket the flag changes nothing."""
    while view:
        try:
            got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        except (BlockingIOError, InterruptedError):
            _wait(sock, select.POLLIN, timeout, "receive")
            continue
        if got == 0:
            raise PeerLost("peer closed the connection")
        view = view[got:]


def block_in_kernel(sock: socket.socket, timeout: float) -> None:
    """Make ``sock`` blocking, its calls giving up after ``timeout`` seconds in the kernel
    (``SO_RCVTIMEO``/``SO_SNDTIMEO``): for a socket only worker threads use."""
    sock.setblocking(True)
    seconds = max(timeout, 0.001)
    interval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, interval)


def _wait(sock: socket.socket, events: int, timeout: float, what: str) -> None:
    if sock.getblocking():  # the kernel already waited ``timeout`` (``block_in_kernel``)
        raise TransportTimeout(f"a payload {what} made no progress for {timeout:.3g} s")
    poller = select.poll()
    poller.register(sock, events)
    started = time.monotonic()
    if not poller.poll(timeout * 1000):
        raise TransportTimeout(f"a payload {what} made no progress for {time.monotonic() - started:.3g} s")
