"""The reading side of a ``Connection``: one task reads each sealed header, checks it, and
dispatches the message (RTS to the mailbox, CTS/REJECT/ACK to the sends, a CTS nobody sent an RTS
for to the credits expected, DATA into its receive, MSG to the layer above). It never writes to
the link itself: replies go through the connection's control queue (``_post``), so two peers
streaming at each other cannot deadlock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import wire
from .config import TransportConfig
from .errors import AuthenticationFailed, CorruptPayload, PeerLost, ProtocolError, TransferRejected, TransportError
from .flow import Credits, SendState, Window
from .link import Link, log
from .mailbox import Mailbox, Progress, Receive
from .seal import TAG_BYTES, Direction
from .wire import Message, MessageType

if TYPE_CHECKING:
    from .connection import OnMessage

_ACK_FRACTION = 4  # acknowledge at least every max_inflight_bytes / 4 received
_MESSAGE_PIECE = 64 << 10  # a MSG payload is read (and its buffer grown) this much at a time
NO_TAG = bytes(TAG_BYTES)  # the payload tag of a message without a payload


class Reader:
    """Mixed into ``Connection``, which provides what is declared here and the methods
    ``_post`` (queue control messages), ``_reject``, ``_complete`` and ``_fail``."""

    link: Link
    peer: str
    last_activity: float
    _config: TransportConfig
    _in: Direction  # the session's receiving direction
    _mailbox: Mailbox
    _sends: dict[int, SendState]
    _credits: Credits
    _receives: dict[int, Receive]
    progress: Progress  # payload bytes landed on this connection
    _window: Window
    _on_message: OnMessage | None

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
            self._mailbox._announce(self, m.tag, m.total)
        elif m.type == MessageType.CTS:
            state = self._sends.get(m.tag)
            if state is not None and not state.accepted.done():
                state.accepted.set_result(m.total)
            elif state is None:
                self._credits.grant(m.tag, m.total)
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
            self.progress.begin(m.length)  # a peer message's bytes (an inline chunk's) are progress too
            try:
                payload = await self._recv_small(m, seq, tag)
            finally:
                self.progress.reading = 0
            self.progress.land(m.length)
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
            ok = self._in.check_payload(seq, payload, tag) if m.length else tag == NO_TAG
        if not ok:
            raise AuthenticationFailed(f"a {m.type.name} from {self.peer} failed its authentication tag")
        return payload

    async def _on_data(self, m: Message, seq: int, tag: bytes) -> None:
        """One DATA: its payload into its receive, or dropped. Whichever, the payload's bytes are
        the connection's progress as they come (a payload dropped included: the peer delivers it),
        as much of it as one message of this connection's may hold."""
        self.progress.begin(min(m.length, self._config.chunk_bytes))
        try:
            await self._take_data(m, seq, tag)
        finally:
            self.progress.reading = 0

    async def _drop(self, m: Message) -> None:
        await self.link.discard(m.length, striped=True)
        self.progress.land(m.length)

    async def _take_data(self, m: Message, seq: int, tag: bytes) -> None:
        receive = self._receives.get(m.tag)
        if receive is None or receive.done:
            # Cancelled or timed out here while the sender was mid-transfer, refused by the layer
            # above, or never granted: drop its bytes, tell it, keep the connection.
            await self._drop(m)
            if receive is not None:
                self._receives.pop(m.tag, None)
                self._reject(m.tag, f"receive {m.tag:#x} was cancelled")
            elif m.offset == 0:  # once a payload, not for each of its messages
                self._reject(m.tag, self._mailbox.refusal(m.tag) or f"no receive posted for {m.tag:#x}")
            return
        if receive.total is None:  # granted: its size comes with its first DATA
            if m.total > receive.buffer.nbytes:
                await self._drop(m)
                reason = f"transfer {m.tag:#x} of {m.total} bytes does not fit a {receive.buffer.nbytes}-byte buffer"
                receive.fail(TransferRejected(reason))
                self._reject(m.tag, reason)
                return
            receive.total = m.total
        if m.total != receive.total or m.offset + m.length > receive.total:
            raise ProtocolError(f"DATA for {m.tag:#x} outside the announced {receive.total} bytes")
        if m.offset != receive.received:  # a payload is sent in order: done means every byte came
            raise ProtocolError(f"DATA for {m.tag:#x} at byte {m.offset}, where {receive.received} came before")
        region = receive.buffer.region(m.offset, m.offset + m.length)
        digest = bool(m.flags & wire.FLAG_DIGEST)
        if not m.length:  # an empty transfer's one DATA: no payload, so no payload tag
            ok = tag == NO_TAG and not digest
        elif self._in.encrypt:
            if digest:
                raise ProtocolError("a device digest on an encrypted connection")
            ok = await self._recv_encrypted(region, seq, tag)
        elif receive.defer_check and (digest or not self.link.stages_device_payloads):
            # Checked later on the GPU, beside its decode: the reader goes on to the next message.
            receive._checks.append((m.offset, m.length, self._in, seq, tag, digest))
            ok = await self.link.recv_payload(region, striped=True)
        else:
            ok = await self.link.recv_payload(region, self._verifier(seq, tag, digest), striped=True)
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

        verify.on_device = digest  # type: ignore[attr-defined]  # a backend may land it first, then check
        return verify

    async def _recv_encrypted(self, region: Any, seq: int, tag: bytes) -> bool:
        """Ciphertext through host memory, decrypted into ``region`` only if it is authentic."""
        ciphertext = bytearray(len(region) if not hasattr(region, "numel") else region.numel())
        await self.link.recv_payload(memoryview(ciphertext), striped=True)
        if hasattr(region, "is_cuda"):
            plain = bytearray(len(ciphertext))
            if not self._in.open_into(seq, bytes(ciphertext), tag, plain):
                return False
            import torch

            region.copy_(torch.frombuffer(plain, dtype=torch.uint8) if plain else region.new_empty(0))
            return True
        return self._in.open_into(seq, bytes(ciphertext), tag, region)
