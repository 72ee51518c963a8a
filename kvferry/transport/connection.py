"""Transfers over one link: announce, accept, chunked data, acknowledgements (see wire.py).

Several transfers share a connection, each named by a 64-bit tag; their chunks interleave.
Receives are posted in a ``Mailbox`` (shared by all connections of a listener, since the
receiver does not know which connection a sender will use) before data may flow, so nothing
arrives that has no place to go: no unbounded buffering. The sender keeps at most
``max_inflight_bytes`` sent and not yet acknowledged per connection. The reader task never
writes to the link itself (control messages go through a queue), so two peers streaming at
each other cannot deadlock on full socket buffers. Any link failure fails every pending
operation on the connection with the same typed error.

Small messages of the layer above (MSG) travel in order with the rest and are handed, whole, to
the connection's ``on_message`` callback from the reader: the engine's peer protocol rides on the
same authenticated connection as the data it describes.

Every message is sealed with the session's keys and its sequence number (``seal.py``): a header
that fails its tag closes the connection before anything in it is acted on; a payload that
fails its tag fails its transfer (nothing of it is handed on).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from . import wire
from .buffers import Buffer
from .config import TransportConfig
from .errors import (AuthenticationFailed, CorruptPayload, PeerLost, ProtocolError, TransferRejected, TransportClosed,
                     TransportError, TransportTimeout)
from .handshake import Session
from .link import Link, log
from .seal import TAG_BYTES, Digest, Direction
from .waiting import until_ready
from .wire import Message, MessageType

_ACK_FRACTION = 4  # acknowledge at least every max_inflight_bytes / 4 received
_DISCARD_CHUNK = 1 << 20
_MESSAGE_PIECE = 64 << 10  # a MSG payload is read (and its buffer grown) this much at a time
_NO_TAG = bytes(TAG_BYTES)


class Receive:
    """A posted receive: the buffer a transfer with ``tag`` will be written into.

    ``wait`` returns the transfer's size once its last byte is in the buffer (checked, unless the
    consumer deferred the check: ``start_check``) and fails if the transfer makes no progress for
    ``timeout`` seconds.
    """

    def __init__(self, tag: int, buffer: Any, mailbox: Mailbox, defer_check: bool = False):
        self.tag = tag
        self.buffer = Buffer(buffer, writable=True)
        # A device buffer's consumer may check the payload's CRCs itself, on its own stream with
        # its own work (``start_check``): the check then costs no wait of its own on the path.
        self.defer_check = defer_check and bool(getattr(buffer, "is_cuda", False))
        self._checks: list[tuple[int, int, Direction, int, bytes, bool]] = []
        self.total: int | None = None
        self.received = 0
        self._unacked = 0
        self._mailbox = mailbox
        self._future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._progress = time.monotonic()

    @property
    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout: float) -> int:
        """Bytes received, once all have landed.

        Raises:
            TransportTimeout: no progress for ``timeout`` seconds (the receive is cancelled).
            TransferRejected, PeerLost, ProtocolError, TransportClosed: as the transfer failed.
        """
        while not self._future.done():
            remaining = self._progress + timeout - time.monotonic()
            if remaining <= 0:
                self.fail(TransportTimeout(f"transfer {self.tag:#x}: no data for {timeout:g} s"))
                break
            # TransportTimeout is itself a TimeoutError: look at the future, not the exception.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await asyncio.shield(self._future)
        return self._future.result()

    def start_check(self) -> Callable[[], None]:
        """For a ``defer_check`` receive, once ``wait`` returned: launch the checks of the bytes
        received on the current CUDA stream; the returned function raises ``CorruptPayload`` if
        any failed (it waits for the stream). Until it returns, the bytes are unverified."""
        pending = []
        for offset, length, direction, seq, tag, digest in self._checks:
            region = self.buffer.region(offset, offset + length)
            if digest:
                pending.append((offset, length, direction, seq, tag, direction.digest(region)))
            else:  # a host sender's payload into this GPU: its tag needs the bytes on the host
                pending.append((offset, length, direction, seq, tag, region.cpu().numpy()))

        def check() -> None:
            for offset, length, direction, seq, tag, value in pending:
                ok = (direction.check_digest(seq, value(), tag) if isinstance(value, Digest)
                      else direction.check_payload(seq, value, tag))
                if not ok:
                    raise CorruptPayload(f"transfer {self.tag:#x}: bytes [{offset}, {offset + length}) failed "
                                         "their authentication tag")

        return check

    def cancel(self) -> None:
        self.fail(TransportClosed(f"receive {self.tag:#x} cancelled"))

    def fail(self, exc: Exception) -> None:
        if not self._future.done():
            self._future.set_exception(exc)
            self._future.exception()  # retrieved: a receive nobody waits on must not warn
        self._mailbox._forget(self)

    def _landed(self, n: int) -> None:
        self.received += n
        self._unacked += n
        self._progress = time.monotonic()

    def _finish(self) -> None:
        if not self._future.done():
            self._future.set_result(self.received)
        self._mailbox._forget(self)


class Mailbox:
    """Posted receives by tag, and announcements (RTS) that arrived before their receive."""

    def __init__(self, max_early: int = 4096, max_refused: int = 1 << 16):
        self._expected: dict[int, Receive] = {}
        self._early: dict[int, tuple[Connection, int]] = {}
        self._max_early = max_early
        self._refused: collections.OrderedDict[int, str] = collections.OrderedDict()  # oldest first
        self._max_refused = max_refused

    def refuse(self, tags: list[int], reason: str) -> None:
        """Reject transfers ``tags`` whether they were announced already or arrive later (the
        layer above refused what they belong to), so no sender waits on them."""
        for tag in tags:
            early = self._early.pop(tag, None)
            if early is not None:
                early[0]._reject(tag, reason)
            else:
                self._refused[tag] = reason
        while len(self._refused) > self._max_refused:
            self._refused.popitem(last=False)

    def expect(self, tag: int, buffer: Any, defer_check: bool = False) -> Receive:
        """Post a receive of transfer ``tag`` into ``buffer`` (host or CUDA, contiguous); with
        ``defer_check``, a CUDA buffer's payload CRCs are left to ``Receive.start_check``.

        Raises:
            ValueError: a receive for ``tag`` is already posted, or the buffer is not usable.
        """
        if tag in self._expected:
            raise ValueError(f"a receive for tag {tag:#x} is already posted")
        receive = Receive(tag, buffer, self, defer_check)
        self._expected[tag] = receive
        early = self._early.pop(tag, None)
        if early is not None:
            connection, total = early
            connection._accept(receive, total)
        return receive

    def _announce(self, connection: Connection, tag: int, total: int, eager: bool = False) -> None:
        refused = self._refused.pop(tag, None)
        if refused is not None:
            connection._reject(tag, refused)
            return
        receive = self._expected.get(tag)
        if receive is not None and receive.total is None:
            connection._accept(receive, total, eager)
        elif eager:  # its DATA is already on the way and has nowhere to go: it is discarded
            connection._reject(tag, f"no receive posted for eager transfer {tag:#x}")
        elif receive is not None or tag in self._early:
            connection._reject(tag, f"transfer {tag:#x} is already in progress")
        elif len(self._early) >= self._max_early:
            connection._reject(tag, "too many transfers announced without a posted receive")
        else:
            self._early[tag] = (connection, total)

    def _forget(self, receive: Receive) -> None:
        if self._expected.get(receive.tag) is receive:
            del self._expected[receive.tag]

    def _drop_connection(self, connection: Connection) -> None:
        for tag in [t for t, (c, _) in self._early.items() if c is connection]:
            del self._early[tag]


class _Send:
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[int] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.sent = 0
        self.acked = 0

    def fail(self, exc: Exception) -> None:
        for future in (self.accepted, self.done):
            if not future.done():
                future.set_exception(exc)
                future.exception()


class _Window:
    """Bytes sent and not yet acknowledged, bounded: senders wait for room."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._changed = asyncio.Condition()
        self._error: Exception | None = None

    def try_acquire(self, n: int) -> bool:
        """Take room at once if there is some (the common case: no task, no wait)."""
        if self._error is None and self.used + n <= self.capacity and not self._changed.locked():
            self.used += n
            return True
        return False

    async def acquire(self, n: int, timeout: float) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._error is not None or self.used + n <= self.capacity),
                    timeout)
            except asyncio.TimeoutError:
                raise TransportTimeout(f"receiver acknowledged nothing for {timeout:g} s") from None
            if self._error is not None:
                raise self._error
            self.used += n

    async def release(self, n: int) -> None:
        async with self._changed:
            self.used = max(0, self.used - n)
            self._changed.notify_all()

    async def fail(self, exc: Exception) -> None:
        async with self._changed:
            self._error = exc
            self._changed.notify_all()


class _Pacer:
    """Sender-side pacing to a fixed rate: stands in for a slower link in benchmarks. A message's
    write is timed to end when a link of that rate, busy with the messages before it, would have
    delivered its last byte, so even a one-message transfer takes at least its size over the rate.

    The write itself (the loopback's own copy) is the link's serialization, not extra time: it is
    started that much early. Its duration is estimated from the fastest earlier write, so it never
    ends early; until one was measured a message waits for its whole serialization first, and a
    write that runs longer than estimated leaves the link idle meanwhile (both only ever slow the
    emulated link down)."""

    def __init__(self, bytes_per_s: float):
        self._rate = bytes_per_s
        self._free_at = time.monotonic()
        self._loopback = 0.0  # bytes per second of our fastest write (0: none measured yet)

    async def admit(self, n: int) -> None:
        now = time.monotonic()
        self._free_at = max(now, self._free_at) + n / self._rate
        lead = n / self._loopback if self._loopback else 0.0
        await asyncio.sleep(self._free_at - lead - now)

    def wrote(self, n: int, seconds: float) -> None:
        if seconds > 0:
            self._loopback = max(self._loopback, n / seconds)


OnMessage = Callable[["Connection", bytearray], None]  # the payload is the callee's to keep


class Connection:
    """A multiplexed, flow-controlled connection to one peer (already authenticated)."""

    _ids = itertools.count(1)

    def __init__(self, link: Link, config: TransportConfig, mailbox: Mailbox, session: Session,
                 on_message: OnMessage | None = None):
        self.link = link
        self._out = session.send
        self._in = session.receive
        self.peer = link.peer
        self.id = next(self._ids)
        self._config = config
        self._mailbox = mailbox
        self._write_lock = asyncio.Lock()
        self._window = _Window(config.max_inflight_bytes)
        self._pacer = _Pacer(config.pace_bytes_per_s) if config.pace_bytes_per_s > 0 else None
        self._sends: dict[int, _Send] = {}
        self._receives: dict[int, Receive] = {}
        self._control: asyncio.Queue[Message | bytes | None] = asyncio.Queue()
        self._on_message = on_message
        self._close_callbacks: list[Callable[[Connection, Exception], None]] = []
        self._error: Exception | None = None
        self._closed = asyncio.Event()
        self.last_activity = time.monotonic()
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._controller = asyncio.get_running_loop().create_task(self._control_loop())

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def idle(self) -> bool:
        """Nothing in flight either way (an idle connection may be closed without harm)."""
        return not self._sends and not self._receives

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def on_close(self, callback: Callable[[Connection, Exception], None]) -> None:
        """Call ``callback(connection, error)`` once when the connection fails or closes."""
        if self._error is not None:
            callback(self, self._error)
        else:
            self._close_callbacks.append(callback)

    # ---- messages of the layer above ---------------------------------------------------------
    async def send_message(self, *payloads: bytes) -> None:
        """Send MSGs, in order after everything written before them, in one write where possible.

        Raises:
            ProtocolError: one is over ``wire.MAX_MESSAGE_BYTES``. PeerLost, TransportClosed, TransportTimeout.
        """
        for payload in payloads:
            if len(payload) > wire.MAX_MESSAGE_BYTES:
                raise ProtocolError(f"message of {len(payload)} bytes is over {wire.MAX_MESSAGE_BYTES}")
        await self._write_many([(Message(MessageType.MSG, length=len(p)), memoryview(p)) for p in payloads])

    def post_message(self, *payloads: bytes) -> None:
        """Send MSGs without waiting (from callbacks that cannot await): written here and now when
        nothing is queued or being written before them, else queued behind it; dropped if closed."""
        self._post([(Message(MessageType.MSG, length=len(p)), memoryview(p)) for p in payloads])

    def _post(self, messages: list[tuple[Message, Any]]) -> None:
        """Write ``messages`` without waiting: at once when the link is free and nothing is queued
        (the reader's CTS and ACKs skip a hop through the control task: each hop is a wake-up on
        a message's path), else behind what is queued; dropped if closed."""
        if self._error is not None:
            return
        if not self._control.empty() or not self._try_lock():
            for message, payload in messages:
                self._control.put_nowait(message)
                if payload is not None:
                    self._control.put_nowait(bytes(payload))
            return
        try:
            self._write_locked(messages)
        except Exception as exc:  # nobody awaits this: the connection fails (and says why) instead
            failure = exc if isinstance(exc, TransportError) else ProtocolError(f"cannot write a message: {exc!r}")
            asyncio.ensure_future(self._fail(failure))

    def _try_lock(self) -> bool:
        """Take the write lock without suspending, if it is free (``asyncio.Lock.acquire`` returns
        at once then: its coroutine finishes on the first step)."""
        if self._write_lock.locked():
            return False
        acquire = self._write_lock.acquire()
        try:
            acquire.send(None)
        except StopIteration:
            return True
        acquire.close()  # a waiter woken but not yet run holds the turn: queue behind it
        return False

    # ---- sending -------------------------------------------------------------------------
    async def send(self, tag: int, payload: Any, *, timeout: float | None = None, eager: bool = False) -> None:
        """Send ``payload`` (host or CUDA buffer) as transfer ``tag``; returns once the receiver
        has every byte in its buffer. ``eager``: the caller knows the receive is posted (the layer
        above arranged it, in order on this connection), so DATA goes without waiting for CTS.

        Raises:
            TransferRejected: the receiver refused it (no receive posted in time is a timeout).
            TransportTimeout: no progress for ``timeout`` (default ``op_timeout``) seconds.
            PeerLost, TransportClosed, ProtocolError: the connection failed.
        """
        timeout = self._config.op_timeout if timeout is None else timeout
        self._check_open()
        if tag in self._sends:
            raise ValueError(f"a send with tag {tag:#x} is already in progress on this connection")
        data = Buffer(payload)
        chunk = self._config.chunk_bytes
        spans = [(offset, min(chunk, data.nbytes - offset)) for offset in range(0, data.nbytes, chunk)]
        state = self._sends[tag] = _Send()
        try:
            # GPU to GPU: the payload's digests are launched first and awaited without blocking
            # the loop, behind the rendezvous where there is one.
            crcs = ([self._out.digest(data.region(offset, offset + n)) for offset, n in spans]
                    if data.is_device and not self._stages_device_payloads else None)
            rts = Message(MessageType.RTS, tag, total=data.nbytes, flags=wire.FLAG_EAGER if eager else 0)
            if not eager:
                await self._write(rts)
                await self._await(state.accepted, timeout, f"transfer {tag:#x}: receiver did not accept")
                rts = None
            if crcs:
                await until_ready(*crcs, timeout=timeout, what=f"transfer {tag:#x}: checksum")
            for index, (offset, n) in enumerate(spans):
                await self._room_for(state, n, timeout)
                if self._pacer is not None:
                    await self._pacer.admit(n)
                state.sent += n
                header = Message(MessageType.DATA, tag, offset, n, data.nbytes)
                payload = data.region(offset, offset + n)
                if crcs:
                    header = dataclasses.replace(header, flags=wire.FLAG_DIGEST)
                    payload = _Digested(payload, crcs[index]())
                message = (header, payload)
                started = time.monotonic()
                await self._write_many([(rts, None), message] if rts is not None else [message])
                if self._pacer is not None:
                    self._pacer.wrote(n, time.monotonic() - started)
                rts = None  # an eager RTS leaves with the first DATA, in the same write
            if rts is not None:  # an empty eager transfer
                await self._write(rts)
            await self._await(state.done, timeout, f"transfer {tag:#x}: receiver did not confirm")
        finally:
            del self._sends[tag]
            if state.sent > state.acked and not self.closed:
                await self._window.release(state.sent - state.acked)

    async def _room_for(self, state: _Send, n: int, timeout: float) -> None:
        """Wait for window room, but give up as soon as the receiver rejects the transfer."""
        if state.done.done():
            state.done.result()  # raises the rejection or connection failure
        if self._window.try_acquire(n):
            return
        acquire = asyncio.ensure_future(self._window.acquire(n, timeout))
        finished, _ = await asyncio.wait({acquire, state.done}, return_when=asyncio.FIRST_COMPLETED)
        if acquire in finished:
            acquire.result()
            return
        acquire.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if await asyncio.gather(acquire, return_exceptions=True) == [None]:
                await self._window.release(n)  # it got room just as the rejection came
        state.done.result()  # raises the rejection or connection failure
        raise TransportClosed("transfer completed before it was sent")

    async def _await(self, future: asyncio.Future, timeout: float, what: str) -> Any:
        if future.done():
            return future.result()
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done():
                return future.result()  # its own error, a TimeoutError too, is the one to raise
            raise TransportTimeout(f"{what} within {timeout:g} s") from None

    async def _write(self, message: Message, payload: Any = None) -> None:
        await self._write_many([(message, payload)])

    async def _write_many(self, messages: list[tuple[Message, Any]]) -> None:
        """Write messages whole and in order, in as few system calls as the backend allows. A
        caller cancelled mid-write does not cut a message short (the peer would lose framing):
        the write finishes in the background, holding the lock."""
        self._check_open()
        await self._write_lock.acquire()
        try:
            self._check_open()
        except TransportError:
            self._write_lock.release()
            raise
        try:
            write = self._write_locked(messages)
        except TransportError as exc:
            await self._fail(exc)
            raise
        if write is not None:
            await asyncio.shield(write)

    @property
    def _stages_device_payloads(self) -> bool:
        """Device payloads go through host memory: the backend stages them, or they are encrypted."""
        return self.link.stages_device_payloads or self._out.encrypt

    def _parts(self, messages: list[tuple[Message, Any]]) -> list[Any]:
        """Sealed headers and payloads in order, each message taking the next sequence number
        (so this runs under the write lock, in the order the parts are written). Device payloads
        reach here without a digest only where they are staged: they are staged here."""
        self.last_activity = time.monotonic()
        parts = []
        for seq, (message, payload) in enumerate(messages, self._out.seq):
            tag = _NO_TAG
            if isinstance(payload, _Digested):
                tag, payload = self._out.digest_tag(seq, payload.digest), payload.region
            elif payload is not None and len(payload):
                if getattr(payload, "is_cuda", False):
                    payload = memoryview(payload.cpu().numpy())
                if self._out.encrypt:
                    payload, tag = self._out.seal(seq, payload)
                else:
                    tag = self._out.payload_tag(seq, payload)
            header = message.pack()
            parts.append(header + tag + self._out.header_tag(seq, header, tag))
            if payload is not None and len(payload):
                parts.append(payload)
        self._out.seq += len(messages)  # only once all are sealed: a failure here writes nothing
        return parts

    def _write_locked(self, messages: list[tuple[Message, Any]]) -> asyncio.Future | None:
        """Write ``messages`` holding the write lock, which this releases when they are all out:
        here and now if the socket takes them (None), else by the future returned; and at once on
        any error (a checksum that cannot be computed writes nothing: the framing holds)."""
        try:
            rest = self.link.send_now(self._parts(messages))  # most writes go out whole, here and now
        except BaseException:
            self._write_lock.release()
            raise
        if not rest:
            self._write_lock.release()
            return None
        write = asyncio.ensure_future(self._send_message(rest))
        write.add_done_callback(lambda _: self._write_lock.release())
        return write

    async def _send_message(self, parts: list[Any]) -> None:
        try:
            async with asyncio.timeout(self._config.op_timeout):
                await self.link.send_rest(parts)
        except TimeoutError:
            # A write cut short leaves the stream mid-message: the connection cannot go on.
            exc = TransportTimeout(f"{self.peer}: a write made no progress for {self._config.op_timeout:g} s")
            await self._fail(exc)
            raise exc from None
        except TransportError as exc:
            await self._fail(exc)
            raise

    # ---- receiving -----------------------------------------------------------------------
    async def recv(self, tag: int, buffer: Any, *, timeout: float | None = None) -> int:
        """Post a receive for ``tag`` in this connection's mailbox and wait for it."""
        self._check_open()
        receive = self._mailbox.expect(tag, buffer)
        return await receive.wait(self._config.op_timeout if timeout is None else timeout)

    def _accept(self, receive: Receive, total: int, eager: bool = False) -> None:
        if self.closed:
            receive.fail(self._error)
            return
        if total > receive.buffer.nbytes:
            reason = f"transfer {receive.tag:#x} of {total} bytes does not fit a {receive.buffer.nbytes}-byte buffer"
            receive.fail(TransferRejected(reason))
            self._reject(receive.tag, reason)
            return
        receive.total = total
        self._receives[receive.tag] = receive
        if not eager:
            self._post([(Message(MessageType.CTS, receive.tag, total=total), None)])
        if total == 0:
            self._complete(receive)

    def _reject(self, tag: int, reason: str) -> None:
        text = reason.encode()[: wire.MAX_REASON_BYTES]
        self._post([(Message(MessageType.REJECT, tag, length=len(text)), memoryview(text))])

    def _complete(self, receive: Receive) -> None:
        self._post([(Message(MessageType.ACK, receive.tag, length=receive._unacked, flags=wire.FLAG_DONE), None)])
        receive._unacked = 0
        self._receives.pop(receive.tag, None)
        receive._finish()

    async def _control_loop(self) -> None:
        """Writes CTS, REJECT, ACK and queued MSGs, so the reader never blocks on the link; what
        queued up meanwhile goes out in one write."""
        while True:
            batch: list[tuple[Message, Any]] = []
            item = await self._control.get()
            while True:
                if item is None:
                    if batch:
                        with contextlib.suppress(TransportError):
                            await self._write_many(batch)
                    return
                if isinstance(item, Message) and item.type in (MessageType.REJECT, MessageType.MSG):
                    batch.append((item, memoryview(self._control.get_nowait())))
                else:
                    batch.append((item, None))
                if self._control.empty():
                    break
                item = self._control.get_nowait()
            try:
                await self._write_many(batch)
            except TransportError:
                return

    async def _read_loop(self) -> None:
        try:
            while True:
                sealed = await self.link.recv_header(wire.SEALED_HEADER_SIZE)
                header, tag = sealed[:wire.HEADER_SIZE], sealed[wire.HEADER_SIZE:wire.HEADER_SIZE + TAG_BYTES]
                message = wire.unpack(header)
                seq = self._in.next()
                if not self._in.check_header(seq, header, tag, sealed[wire.HEADER_SIZE + TAG_BYTES:]):
                    raise AuthenticationFailed(f"a message from {self.peer} failed its authentication tag "
                                               "(forged, replayed, reordered or damaged): connection closed")
                self.last_activity = time.monotonic()
                await self._dispatch(message, seq, tag)
        except TransportError as exc:
            await self._fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not leave operations hanging
            log.exception("connection %s reader failed", self.peer)
            await self._fail(ProtocolError(f"reader failed: {exc!r}"))

    async def _dispatch(self, m: Message, seq: int, tag: bytes) -> None:
        if m.type == MessageType.RTS:
            self._mailbox._announce(self, m.tag, m.total, bool(m.flags & wire.FLAG_EAGER))
        elif m.type == MessageType.CTS:
            state = self._sends.get(m.tag)
            if state is not None and not state.accepted.done():
                state.accepted.set_result(m.total)
        elif m.type == MessageType.REJECT:
            reason = await self._recv_small(m, seq, tag)
            state = self._sends.get(m.tag)
            if state is not None:
                state.fail(TransferRejected(reason.decode(errors="replace")))
        elif m.type == MessageType.DATA:
            await self._on_data(m, seq, tag)
        elif m.type == MessageType.ACK:
            state = self._sends.get(m.tag)
            if state is not None:
                n = min(m.length, state.sent - state.acked)
                state.acked += n
                await self._window.release(n)
                if m.flags & wire.FLAG_DONE and not state.done.done():
                    state.done.set_result(None)
        elif m.type == MessageType.MSG:
            payload = await self._recv_small(m, seq, tag)
            if self._on_message is None:
                raise ProtocolError("MSG on a connection that takes none")
            try:
                self._on_message(self, payload)
            except Exception:  # the layer above's bug must not take the connection down
                log.exception("message handler failed on connection %s", self.peer)
        elif m.type == MessageType.GOODBYE:
            raise PeerLost(f"{self.peer} closed the connection")
        else:
            raise ProtocolError(f"unexpected {m.type.name} after the handshake")

    async def _recv_small(self, m: Message, seq: int, tag: bytes) -> bytearray:
        """A MSG's or REJECT's payload, its buffer grown as its bytes arrive (a header alone
        costs no more than its own bytes), authenticated (or decrypted) before it is handed on.

        Raises:
            AuthenticationFailed: it fails its tag (the connection cannot be trusted further).
        """
        if m.length <= _MESSAGE_PIECE or not self.link.streams:  # UCX: one message, one buffer
            payload = bytearray(m.length)
            await self.link.recv_payload(memoryview(payload))
        else:
            payload = bytearray()
            while len(payload) < m.length:
                piece = bytearray(min(_MESSAGE_PIECE, m.length - len(payload)))
                await self.link.recv_payload(memoryview(piece))
                payload += piece
        if self._in.encrypt and m.length:
            ok = self._in.open_into(seq, bytes(payload), tag, payload)
        else:
            ok = self._in.check_payload(seq, payload, tag) if m.length else tag == _NO_TAG
        if not ok:
            raise AuthenticationFailed(f"a {m.type.name} from {self.peer} failed its authentication tag")
        return payload

    async def _on_data(self, m: Message, seq: int, tag: bytes) -> None:
        receive = self._receives.get(m.tag)
        if receive is None or receive.done:
            # Cancelled or timed out here while the sender was mid-transfer: drop its bytes,
            # tell it once, keep the connection.
            await self._discard(m.length)
            if receive is not None:
                self._receives.pop(m.tag, None)
                self._reject(m.tag, f"receive {m.tag:#x} was cancelled")
            return
        if m.total != receive.total or m.offset + m.length > receive.total:
            raise ProtocolError(f"DATA for {m.tag:#x} outside the announced {receive.total} bytes")
        region = receive.buffer.region(m.offset, m.offset + m.length)
        digest = bool(m.flags & wire.FLAG_DIGEST)
        if self._in.encrypt:
            if digest:
                raise ProtocolError("a device digest on an encrypted connection")
            ok = await self._recv_encrypted(region, seq, tag)
        elif receive.defer_check and not self.link.stages_device_payloads:
            receive._checks.append((m.offset, m.length, self._in, seq, tag, digest))
            ok = await self.link.recv_payload(region)
        else:
            ok = await self.link.recv_payload(region, self._verifier(seq, tag, digest))
        if not ok:
            # The framing is intact (the header's own CRC passed): fail this transfer, keep the link.
            self._receives.pop(m.tag, None)
            receive.fail(CorruptPayload(f"transfer {m.tag:#x}: bytes [{m.offset}, {m.offset + m.length}) failed "
                                        "their authentication tag"))
            self._reject(m.tag, "payload authentication failed")
            return
        receive._landed(m.length)
        if receive.received >= receive.total:
            self._complete(receive)
        elif receive._unacked >= self._config.max_inflight_bytes // _ACK_FRACTION:
            self._post([(Message(MessageType.ACK, m.tag, length=receive._unacked), None)])
            receive._unacked = 0

    def _verifier(self, seq: int, tag: bytes, digest: bool) -> Callable[[Any], bool]:
        """The check of one DATA payload's bytes, which a backend applies where they landed
        (host bytes, or a CUDA tensor it received into)."""
        direction = self._in

        def verify(data: Any) -> bool:
            if digest:
                return direction.check_digest(seq, direction.digest(data)(), tag)
            return direction.check_payload(seq, data.cpu().numpy() if hasattr(data, "is_cuda") else data, tag)

        return verify

    async def _recv_encrypted(self, region: Any, seq: int, tag: bytes) -> bool:
        """Ciphertext through host memory, decrypted into ``region`` only if it is authentic."""
        ciphertext = bytearray(len(region) if not hasattr(region, "numel") else region.numel())
        await self.link.recv_payload(memoryview(ciphertext))
        if hasattr(region, "is_cuda"):
            plain = bytearray(len(ciphertext))
            if not self._in.open_into(seq, bytes(ciphertext), tag, plain):
                return False
            import torch

            region.copy_(torch.frombuffer(plain, dtype=torch.uint8) if plain else region.new_empty(0))
            return True
        return self._in.open_into(seq, bytes(ciphertext), tag, region)

    async def _discard(self, n: int) -> None:
        scratch = bytearray(min(n, _DISCARD_CHUNK))
        while n:
            k = min(n, len(scratch))
            await self.link.recv_payload(memoryview(scratch)[:k])
            n -= k

    # ---- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error

    async def _fail(self, exc: Exception) -> None:
        """Fail every pending operation with ``exc`` and drop the link (idempotent)."""
        if self._error is not None:
            return
        self._error = exc
        for state in self._sends.values():
            state.fail(exc)
        for receive in list(self._receives.values()):
            receive.fail(exc)
        self._receives.clear()
        self._mailbox._drop_connection(self)
        await self._window.fail(exc)
        self._control.put_nowait(None)
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback(self, exc)
            except Exception:
                log.exception("close callback failed on connection %s", self.peer)
        await self.link.close()
        current = asyncio.current_task()
        for task in (self._reader, self._controller):
            if task is not current:
                task.cancel()
        self._closed.set()

    async def close(self) -> None:
        """Let in-flight sends finish (up to ``close_timeout``), say goodbye, close. Operations
        still pending then fail with TransportClosed."""
        if self.closed:
            await self._closed.wait()
            return
        deadline = time.monotonic() + self._config.close_timeout
        while self._sends and time.monotonic() < deadline and not self.closed:
            await asyncio.sleep(0.01)
        if not self.closed:
            with contextlib.suppress(TransportError, asyncio.TimeoutError):
                async with self._write_lock:
                    await asyncio.wait_for(self.link.send(self._parts([(Message(MessageType.GOODBYE), None)])[0]),
                                           self._config.close_timeout)
        await self._fail(TransportClosed(f"connection to {self.peer} closed"))


@dataclasses.dataclass(frozen=True)
class _Digested:
    """A device payload with its digest computed (``Session.send.digest``)."""

    region: Any
    digest: bytes
