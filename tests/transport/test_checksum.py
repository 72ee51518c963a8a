"""Payload checksums: the segmented CRC32C that device payloads carry, its CPU reference and the
GPU kernel, bit for bit; and that a device payload whose bytes changed on the way is refused."""

from __future__ import annotations

import asyncio
import os

import google_crc32c
import numpy as np
import pytest
import torch

from kvferry import transport
from kvferry.transport import checksum, wire
from kvferry.transport.wire import Message, MessageType
from tests.transport.conftest import config, run


def _bytewise(data: bytes) -> int:
    """CRC32C one byte at a time through ``checksum``'s table: the GPU kernel's arithmetic."""
    table = checksum._table()
    crc = 0xFFFFFFFF
    for byte in data:
        crc = int(table[(crc ^ byte) & 0xFF]) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_the_kernels_table_is_crc32c():
    data = os.urandom(997)
    assert _bytewise(data) == google_crc32c.value(data)
    assert _bytewise(b"123456789") == 0xE3069283  # the CRC32C check value


def _kernel_model(data: bytes) -> int:
    """The GPU kernel's arithmetic in NumPy: 32 lanes of 128 bytes per segment, read as zeros
    then the segment's bytes, eight bytes a step through the slicing tables (a short segment byte
    by byte), joined in a tree through the shift tables."""
    tables = checksum.tables().astype(np.uint32)
    slicing, shifts = tables[:2048].reshape(8, 256), tables[2048:].reshape(5, 4, 256)
    crcs = []
    for start in range(0, len(data), checksum.SEGMENT_BYTES):
        segment = data[start:start + checksum.SEGMENT_BYTES]
        padded = np.frombuffer(bytes(4096 - len(segment)) + segment, dtype=np.uint8).reshape(32, 128)
        c = np.zeros(32, dtype=np.uint32)
        if len(segment) == 4096:
            words = padded.copy().view("<u4").reshape(32, 32)
            for k in range(0, 32, 2):
                c ^= words[:, k]
                two = words[:, k + 1]
                c = (slicing[7][c & 0xFF] ^ slicing[6][(c >> 8) & 0xFF] ^ slicing[5][(c >> 16) & 0xFF]
                     ^ slicing[4][c >> 24] ^ slicing[3][two & 0xFF] ^ slicing[2][(two >> 8) & 0xFF]
                     ^ slicing[1][(two >> 16) & 0xFF] ^ slicing[0][two >> 24])
        else:
            for i in range(128):
                c = slicing[0][(c ^ padded[:, i]) & 0xFF] ^ (c >> 8)
        for level in range(5):
            step = 1 << level
            for lane in range(0, 32, 2 * step):
                t = shifts[level]
                v = c[lane]
                c[lane] = t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24] ^ c[lane + step]
        crcs.append(int(c[0]) ^ google_crc32c.value(bytes(len(segment))))
    return google_crc32c.value(np.array(crcs, dtype="<u4").tobytes())


@pytest.mark.parametrize("size", [1, 100, 4095, 4096, 4097, 3 * 4096 + 5])
def test_the_kernels_tables_and_tree_give_the_segmented_crc(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert _kernel_model(data) == checksum.segmented_crc(data)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_segmented_crc_is_the_crc_of_the_segments_crcs(size):
    data = os.urandom(size)
    segments = [data[i:i + 4096] for i in range(0, size, 4096)]
    expected = google_crc32c.value(b"".join(google_crc32c.value(s).to_bytes(4, "little") for s in segments))
    assert checksum.segmented_crc(data) == expected


def test_golden_segmented_crc():
    data = bytes(range(256)) * 40  # 10,240 bytes: two whole segments and a short one
    assert checksum.segmented_crc(data) == 0xAD324F0D
    assert checksum.verify(memoryview(data), 0xAD324F0D, True)
    assert not checksum.verify(memoryview(data), checksum.crc(data), True)
    assert checksum.verify(memoryview(data), checksum.crc(data), False)


def test_golden_segmented_flag_and_its_rules():
    message = Message(MessageType.DATA, tag=7, length=3, total=3, flags=wire.FLAG_PAYLOAD_CRC | wire.FLAG_SEGMENTED,
                      crc=checksum.segmented_crc(b"abc"))
    packed = message.pack()
    assert packed[6:8] == (12).to_bytes(2, "little")
    assert wire.unpack(packed) == message
    with pytest.raises(wire.ProtocolError, match="reserved"):  # segmented without a CRC
        wire.unpack(Message(MessageType.DATA, tag=7, length=3, total=3, flags=wire.FLAG_SEGMENTED).pack())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("size, offset", [(1, 0), (4095, 0), (4096, 0), (4097, 3), (10 << 20, 1), (64 << 20, 0)])
def test_gpu_segmented_crc_equals_the_reference(size, offset):
    generator = torch.Generator(device="cuda").manual_seed(size)
    data = torch.randint(0, 256, (size + offset,), dtype=torch.uint8, device="cuda", generator=generator)[offset:]
    assert checksum.device_segmented_crc(data) == checksum.segmented_crc(data.cpu().numpy())


@pytest.mark.gpu
@gpu
def test_a_host_senders_plain_crc_is_checked_on_a_device_receive():
    """A CPU sidecar's payload carries the plain CRC32C; a GPU receiver checks it (on the host)."""
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    assert checksum.verify(data.cuda(), checksum.crc(data.numpy()), False)
    assert not checksum.verify(data.cuda(), checksum.crc(data.numpy()) ^ 1, False)


@pytest.mark.gpu
@gpu
def test_a_device_payload_changed_on_the_way_is_refused(backend):
    """A device payload sent GPU to GPU carries the segmented CRC; the receiver checks it on its
    GPU. The bytes are changed between the check's computation and the send (as a faulty link
    would), so the receive fails with CorruptPayload and the connection goes on."""
    async def main():
        cfg = config(backend, chunk_bytes=16 << 20, max_inflight_bytes=64 << 20)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        connection = await transport.connect("127.0.0.1", listener.port, cfg)
        payload = torch.arange(1 << 20, device="cuda").to(torch.uint8)
        # UCX sends the device bytes (segmented CRC, on the GPU); TCP stages them (host CRC).
        name = "start_device_segmented_crc" if backend == "ucxx" else "crc"
        real = getattr(checksum, name)
        calls = []

        def stale(region):  # the sender's checksum, of the bytes before one of them flipped
            value = real(region)
            if backend == "ucxx":
                value = _Computed(value())
            if not calls:
                region[12345] ^= 0xFF
            calls.append(value)
            return value

        setattr(checksum, name, stale)
        try:
            receive = listener.expect(7, torch.zeros_like(payload))
            sent = asyncio.ensure_future(connection.send(7, payload))
            with pytest.raises(transport.TransportError, match="CRC|checksum"):
                await receive.wait(cfg.op_timeout)
            with pytest.raises(transport.TransportError):
                await sent
        finally:
            setattr(checksum, name, real)
        payload = torch.arange(1 << 20, device="cuda").to(torch.uint8)  # and the next one is fine
        target = torch.zeros_like(payload)
        receive = listener.expect(8, target)
        await connection.send(8, payload)
        await receive.wait(cfg.op_timeout)
        torch.cuda.synchronize()
        assert torch.equal(target, payload)
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


@pytest.mark.gpu
@gpu
def test_a_deferred_check_leaves_the_verdict_to_the_consumer(backend):
    """A receive into GPU memory with ``defer_check`` (the engine's: it checks with its decode)
    lands the bytes unverified where the link does not stage them (UCX); ``start_check`` then
    gives the verdict: a payload changed on the way raises CorruptPayload, a sound one passes.
    Over TCP the staged copy is checked on the host as before, and the receive itself fails."""
    async def main():
        cfg = config(backend, chunk_bytes=16 << 20, max_inflight_bytes=64 << 20)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        connection = await transport.connect("127.0.0.1", listener.port, cfg)
        name = "start_device_segmented_crc" if backend == "ucxx" else "crc"
        real = getattr(checksum, name)

        def stale(region):
            value = real(region)
            if backend == "ucxx":
                value = _Computed(value())
            region[4097] ^= 0x01
            return value

        for tag, corrupt in ((1, True), (2, False)):
            payload = torch.arange(3 << 20, device="cuda").to(torch.uint8)
            target = torch.zeros_like(payload)
            receive = listener.expect(tag, target, defer_check=True)
            setattr(checksum, name, stale if corrupt else real)
            try:
                sent = asyncio.ensure_future(connection.send(tag, payload))
                if backend == "tcp" and corrupt:
                    with pytest.raises(transport.CorruptPayload):
                        await receive.wait(cfg.op_timeout)
                    with pytest.raises(transport.TransportError):
                        await sent
                    continue
                await receive.wait(cfg.op_timeout)
                await sent
            finally:
                setattr(checksum, name, real)
            verdict = receive.start_check()
            if corrupt:
                with pytest.raises(transport.CorruptPayload, match="CRC32C"):
                    verdict()
            else:
                verdict()
                torch.cuda.synchronize()
                assert torch.equal(target, payload)
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


def test_a_host_receive_ignores_defer_check():
    """Only device buffers defer: a host receive is checked by the transport, as always."""
    async def main():
        cfg = config("tcp")
        listener = await transport.listen("127.0.0.1", 0, cfg)
        receive = listener.expect(3, bytearray(16), defer_check=True)
        assert not receive.defer_check
        receive.start_check()()  # nothing deferred: nothing to check
        receive.cancel()
        await listener.close()

    run(main(), timeout=30)


class _Computed:
    """A device CRC whose value was taken before the test changed the bytes."""

    def __init__(self, value: int):
        self.value = value

    def ready(self) -> bool:
        return True

    def __call__(self) -> int:
        return self.value
