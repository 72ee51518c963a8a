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
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import wire
from .buffers import Buffer
from .config import TransportConfig
from .errors import ProtocolError, TransferRejected, TransportClosed, TransportError, TransportTimeout
from .flow import Clearance, Credits, Digested, Pacer, SendState, Window
from .handshake import Session
from .link import Link, Striped, log
from .mailbox import Mailbox, Progress, Receive
from .reader import NO_TAG, Reader
from .waiting import until_ready
from .wire import Message, MessageType

OnMessage = Callable[["Connection", bytearray], None]  # the payload is the callee's to keep
# Replies and messages queued behind a busy link, in bytes, each item counted with what keeping it
# costs: a peer that keeps asking (DATA nobody granted, each answered by a REJECT) and never reads
# fails its connection here instead of growing this process by more than it sent.
MAX_CONTROL_BACKLOG = 64 << 20
_ITEM_COST = 256


def _cost(item: object) -> int:
    return _ITEM_COST + (len(item) if isinstance(item, bytes) else 0)


class Connection(Reader):
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
        self._window = Window(config.max_inflight_bytes)
        self._pacer = Pacer(config.pace_bytes_per_s) if config.pace_bytes_per_s > 0 else None
        self._sends: dict[int, SendState] = {}
        self._credits = Credits()
        self._receives: dict[int, Receive] = {}
        self._control: asyncio.Queue[Message | bytes | Callable[[], None] | None] = asyncio.Queue()
        self._on_message = on_message
        self._close_callbacks: list[Callable[[Connection, Exception], None]] = []
        self._error: Exception | None = None
        self._closed = asyncio.Event()
        self.last_activity = time.monotonic()
        self.progress = Progress()  # payload bytes landed here, for the receives it carries
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._backlog = 0  # bytes queued in _control, each item counted with its keep
        self._controller = asyncio.get_running_loop().create_task(self._control_loop())

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def idle(self) -> bool:
        """Nothing in flight either way (an idle connection may be closed without harm). A receive
        that failed is not in flight: it stays only to refuse the rest of its payload by name."""
        return not self._sends and all(receive.done for receive in self._receives.values())

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

    def post_message(self, *payloads: bytes, written: Callable[[], None] | None = None) -> None:
        """Send MSGs without waiting (from callbacks that cannot await): written here and now when
        nothing is queued or being written before them, else queued behind it; dropped if closed.
        ``written`` is called once they are all handed to the link (never if the connection fails
        first): a busy connection may hold them back for a while."""
        self._post([(Message(MessageType.MSG, length=len(p)), memoryview(p)) for p in payloads], written)

    def _post(self, messages: list[tuple[Message, Any]], written: Callable[[], None] | None = None) -> None:
        """Write ``messages`` without waiting: at once when the link is free and nothing is queued
        (the reader's CTS and ACKs skip a hop through the control task: each hop is a wake-up on
        a message's path), else behind what is queued; dropped if closed."""
        if self._error is not None:
            return
        if not self._control.empty() or not self._try_lock():
            for message, payload in messages:
                self._queue(message)
                if payload is not None:
                    self._queue(bytes(payload))
            if written is not None:
                self._queue(written)
            if self._backlog > MAX_CONTROL_BACKLOG:  # the peer sends and does not read what it asks for
                asyncio.ensure_future(self._fail(ProtocolError(
                    f"{self._backlog} bytes of replies queued for a peer that does not read them")))
            return
        try:
            write = self._write_locked(messages)
        except Exception as exc:  # nobody awaits this: the connection fails (and says why) instead
            failure = exc if isinstance(exc, TransportError) else ProtocolError(f"cannot write a message: {exc!r}")
            asyncio.ensure_future(self._fail(failure))
            return
        if written is None:
            return
        if write is None:
            self._tell_written(written)
        else:
            write.add_done_callback(
                lambda w: None if w.cancelled() or w.exception() is not None else self._tell_written(written))

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
    async def send(self, tag: int, payload: Any, *, timeout: float | None = None,
                   clearance: Clearance = Clearance.RENDEZVOUS, granted: Callable[[], None] | None = None,
                   writing: asyncio.Future | None = None) -> None:
        """Send ``payload`` (host or CUDA buffer) as transfer ``tag``; returns once the receiver
        has every byte in its buffer. ``clearance``: by rendezvous, the default (RTS; DATA once the
        receiver's mailbox holds a receive and its CTS says so), or on a buffer the receiver grants
        on this connection (``grant``): its CTS unasked (``CREDIT``), or none, the grant being
        one the layer above knows of (``INITIAL``). ``granted`` is called once the receiver's CTS
        came. ``writing`` is set once the first DATA is being written (its clearance and checks
        done): a caller about to launch more GPU work can let this payload reach the link first.

        Raises:
            TransferRejected: the receiver refused it (no receive posted in time is a timeout).
            TransportTimeout: no progress for ``timeout`` (default ``op_timeout``) seconds.
            PeerLost, TransportClosed, ProtocolError: the connection failed.
        """
        timeout = self._config.op_timeout if timeout is None else timeout
        self._check_open()
        if tag in self._sends:
            raise ValueError(f"a send with tag {tag:#x} is already in progress on this connection")
        credited = self._credits.take(tag) if clearance is Clearance.CREDIT else None
        if clearance is Clearance.CREDIT and credited is None:
            raise ValueError(f"no credit for tag {tag:#x} is expected on this connection")
        data = Buffer(payload)
        chunk = self._config.chunk_bytes
        spans = [(offset, min(chunk, data.nbytes - offset)) for offset in range(0, data.nbytes, chunk)]
        if not spans and clearance is not Clearance.RENDEZVOUS:
            spans = [(0, 0)]  # a granted receive learns its size from DATA: an empty one still sends one
        state = self._sends[tag] = SendState()
        if credited is not None:
            state.accepted = credited
        try:
            # A device payload is authenticated on its GPU: its digests are launched first and
            # awaited without blocking the loop, behind the rendezvous where there is one.
            crcs = ([self._out.digest(data.region(offset, offset + n)) for offset, n in spans]
                    if data.is_device and data.nbytes and not self._out.encrypt else None)
            if clearance is Clearance.RENDEZVOUS:
                await self._write(Message(MessageType.RTS, tag, total=data.nbytes))
            if clearance is not Clearance.INITIAL:
                capacity = await self._await(state.accepted, timeout, f"transfer {tag:#x}: receiver did not accept")
                if capacity < data.nbytes:
                    raise TransferRejected(f"transfer {tag:#x} of {data.nbytes} bytes does not fit the receiver's "
                                           f"{capacity}-byte buffer")
                if granted is not None:
                    granted()
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
                    header = header._replace(flags=wire.FLAG_DIGEST)
                    payload = Digested(payload, crcs[index]())
                started = time.monotonic()
                if writing is not None and not writing.done():
                    writing.set_result(None)
                await self._write(header, payload if n else None)
                if self._pacer is not None:
                    self._pacer.wrote(n, time.monotonic() - started)
            await self._await(state.done, timeout, f"transfer {tag:#x}: receiver did not confirm")
        finally:
            del self._sends[tag]
            if state.sent > state.acked and not self.closed:
                await self._window.release(state.sent - state.acked)

    def expect_credits(self, tags: Iterable[int]) -> None:
        """The receiver will grant these tags (sent with ``Clearance.CREDIT``): its CTS for them
        are kept until their sends begin; any other CTS it sends is dropped."""
        self._credits.expect(tags)

    def forget_credits(self, tags: Iterable[int]) -> None:
        """Expected credits the layer above will not use (its transfer ended)."""
        self._credits.forget(tags)

    def grant(self, tag: int, buffer: Any, *, defer_check: bool = False, tell: bool = True) -> Receive:
        """A credit: a receive of transfer ``tag`` into ``buffer`` on this connection, and, with
        ``tell``, the CTS that lets the sender send it (``Clearance.CREDIT``; without, the sender
        knows of it: ``Clearance.INITIAL``). ``defer_check`` as ``Mailbox.expect``.

        Raises:
            ValueError: a receive of ``tag`` is posted on this connection already.
        """
        if tag in self._receives:
            raise ValueError(f"a receive for tag {tag:#x} is already posted on this connection")
        receive = Receive(tag, buffer, self._mailbox, defer_check, owner=self._receives)
        receive.bind(self.progress)
        if self.closed:
            receive.fail(self._error)
            return receive
        self._receives[tag] = receive
        if tell:
            self._post([(Message(MessageType.CTS, tag, total=receive.buffer.nbytes), None)])
        return receive

    async def _room_for(self, state: SendState, n: int, timeout: float) -> None:
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

    def _parts(self, messages: list[tuple[Message, Any]]) -> list[Any]:
        """Sealed headers and payloads in order, each message taking the next sequence number
        (so this runs under the write lock, in the order the parts are written). Device payloads
        reach here without a digest only to be encrypted: they are copied to the host here."""
        self.last_activity = time.monotonic()
        parts = []
        for seq, (message, payload) in enumerate(messages, self._out.seq):
            tag = NO_TAG
            if isinstance(payload, Digested):
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
                parts.append(Striped(payload) if message.type == MessageType.DATA and self.link.lanes > 1 else payload)
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
        write = asyncio.ensure_future(self._send_message(rest, sum(m.length for m, _ in messages)))
        write.add_done_callback(self._written_rest)
        return write

    def _written_rest(self, write: asyncio.Future) -> None:
        """The lock let go once a write's rest is out. Its failure failed the connection already
        (``_send_message``); a caller cancelled meanwhile no longer awaits it, so it is retrieved here."""
        self._write_lock.release()
        if not write.cancelled():
            write.exception()

    async def _send_message(self, parts: list[Any], nbytes: int) -> None:
        """The rest of messages of ``nbytes`` payload bytes, in ``op_timeout`` and the time those
        bytes take at ``min_bytes_per_s`` (a backend does not say how much of a message is out)."""
        config = self._config
        timeout = config.op_timeout + (nbytes / config.min_bytes_per_s if config.min_bytes_per_s > 0 else 0.0)
        try:
            async with asyncio.timeout(timeout):
                await self.link.send_rest(parts)
        except TimeoutError:
            # A write cut short leaves the stream mid-message: the connection cannot go on.
            exc = TransportTimeout(f"{self.peer}: a write of {nbytes} payload bytes did not finish within "
                                   f"{timeout:g} s")
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

    def _accept(self, receive: Receive, total: int) -> None:
        if self.closed:
            receive.fail(self._error)
            return
        if total > receive.buffer.nbytes:
            reason = f"transfer {receive.tag:#x} of {total} bytes does not fit a {receive.buffer.nbytes}-byte buffer"
            receive.fail(TransferRejected(reason))
            self._reject(receive.tag, reason)
            return
        receive.total = total
        receive.bind(self.progress)
        self._receives[receive.tag] = receive
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

    def _queue(self, item: Message | bytes | Callable[[], None]) -> None:
        self._backlog += _cost(item)
        self._control.put_nowait(item)

    def _dequeue(self) -> Message | bytes | Callable[[], None] | None:
        item = self._control.get_nowait()
        self._backlog -= _cost(item)
        return item

    async def _control_loop(self) -> None:
        """Writes CTS, REJECT, ACK and queued MSGs, so the reader never blocks on the link; what
        queued up meanwhile goes out in one write."""
        while True:
            batch: list[tuple[Message, Any]] = []
            written: list[Callable[[], None]] = []  # posters told once what they posted is out
            item = await self._control.get()
            self._backlog -= _cost(item)
            while True:
                if item is None:
                    if batch:
                        with contextlib.suppress(TransportError):
                            await self._write_many(batch)
                    return
                if isinstance(item, Message) and item.type in (MessageType.REJECT, MessageType.MSG):
                    batch.append((item, memoryview(self._dequeue())))
                elif isinstance(item, Message):
                    batch.append((item, None))
                else:
                    written.append(item)
                if self._control.empty():
                    break
                item = self._dequeue()
            try:
                if batch:
                    await self._write_many(batch)
            except TransportError:
                return
            except Exception as exc:  # nothing else would write what is queued here: the connection fails
                await self._fail(ProtocolError(f"cannot write control messages: {exc!r}"))
                return
            for told in written:
                self._tell_written(told)

    def _tell_written(self, written: Callable[[], None]) -> None:
        """Tell a poster its messages are out; its error is logged (it must not stop this connection's
        writes, nor reach whoever wrote for it)."""
        try:
            written()
        except Exception:
            log.exception("a written callback failed on connection %s", self.peer)

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
        self._credits.fail(exc)
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
