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

from .errors import PeerLost, TransportTimeout

SLICE_BYTES = 4 << 20  # one pinned staging buffer; two per direction per link


class DeviceStaging:
    """The pinned buffers and the copy stream of one link and one direction, created on first
    use (links that never carry a device payload pin nothing)."""

    def __init__(self) -> None:
        self._device: Any = None
        self._buffers: list[Any] = []
        self._events: list[Any] = []
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

    def send(self, sock: socket.socket, payload: Any, timeout: float) -> None:
        """Send the uint8 CUDA tensor ``payload`` (its bytes ready): device → pinned slices →
        socket, the copy of each slice launched while the one before it is sent. Runs in a
        worker thread."""
        import torch

        self._ready_for(payload.device)
        n = payload.numel()
        spans = [(offset, min(SLICE_BYTES, n - offset)) for offset in range(0, n, SLICE_BYTES)]
        with torch.cuda.device(payload.device), torch.cuda.stream(self._stream):
            self._copy_out(payload, spans, 0)
            for k, (_, size) in enumerate(spans):
                if k + 1 < len(spans):
                    self._copy_out(payload, spans, k + 1)
                self._events[k % 2].synchronize()
                _send_all(sock, memoryview(self._buffers[k % 2].numpy())[:size], timeout)

    def _copy_out(self, payload: Any, spans: list[tuple[int, int]], k: int) -> None:
        offset, size = spans[k]
        self._buffers[k % 2][:size].copy_(payload[offset:offset + size], non_blocking=True)
        self._events[k % 2].record(self._stream)

    def recv(self, sock: socket.socket, region: Any, timeout: float) -> None:
        """Fill the uint8 CUDA tensor ``region`` from the socket: socket → pinned slice → device,
        the copy of each slice running while the next one is read. Returns once every byte is
        in ``region``. Runs in a worker thread."""
        import torch

        self._ready_for(region.device)
        n = region.numel()
        pending = [False, False]
        with torch.cuda.device(region.device), torch.cuda.stream(self._stream):
            for k, offset in enumerate(range(0, n, SLICE_BYTES)):
                size, b = min(SLICE_BYTES, n - offset), k % 2
                if pending[b]:
                    self._events[b].synchronize()  # its previous slice has left the buffer
                _recv_all(sock, memoryview(self._buffers[b].numpy())[:size], timeout)
                region[offset:offset + size].copy_(self._buffers[b][:size], non_blocking=True)
                self._events[b].record(self._stream)
                pending[b] = True
            self._stream.synchronize()


def _send_all(sock: socket.socket, view: memoryview, timeout: float) -> None:
    """``sendall`` from a worker thread, giving up after ``timeout`` seconds without progress. A
    blocking lane socket (``block_in_kernel``) sends a slice in one call; a non-blocking one
    waits for room with ``poll``."""
    while view:
        try:
            view = view[sock.send(view):]
        except (BlockingIOError, InterruptedError):
            _wait(sock, select.POLLOUT, timeout, "send")


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
