"""Message authentication, and optional encryption, after the handshake: the one place that
knows how a connection's messages are sealed (their byte layout is in ``wire.py``).

The handshake's two fresh nonces and the peer secret give each direction of a connection its
own 256-bit key (HKDF-SHA256, ``derive``). Every message after the handshake is then sealed with
its direction's key and its sequence number (counted from 0 on each side, never sent): a
message edited, injected, replayed, reordered or dropped fails the next check and the
connection is closed. There is no flag to opt out.

- The header (48 bytes) and the payload's tag are authenticated by AES-GCM with no plaintext
  (GMAC): the 16-byte header tag of ``wire.TRAILER_BYTES``' trailer.
- A host payload is authenticated by GMAC over its bytes (OpenSSL: ~20 GB/s a core), or, with
  ``data_encryption`` on, encrypted by AES-256-GCM (its tag is the payload tag).
- A device payload that UCX moves GPU to GPU is never copied to the host: its *digest*
  (``device_digest``: two NH universal hashes of every 64 KiB segment under a 64 KiB key
  derived from the direction's key, UMAC's construction, computed where the bytes are: one CUDA
  kernel on a GPU, torch operations elsewhere, the same value) is
  authenticated by GMAC instead. An attacker without the key finds two payloads with the same
  digest with probability 2^-64 per segment, and a failed attempt costs the connection.

Nonces never repeat under one key: 8 bytes of sequence number and one byte saying which part
of the message (header, payload, digest) is sealed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
KEY_BYTES = 32
SEGMENT_BYTES = 64 << 10  # a device digest's segment
_SEGMENT_WORDS = SEGMENT_BYTES // 4
_NH_KEY_WORDS = _SEGMENT_WORDS + 4  # two NH passes, the second key shifted by 4 words (Toeplitz)
_NONCE = struct.Struct("<QB3x")
_HEADER, _PAYLOAD, _DIGEST = 0, 1, 2
_MASK = 0xFFFFFFFF
_SLICE_SEGMENTS = 256  # device digests work on 16 MiB at a time (bounded temporaries)


def derive(secret: bytes, nonce_c: bytes, nonce_s: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(connector → acceptor key, acceptor → connector key): HKDF-SHA256 (RFC 5869) with both
    nonces as salt and the handshake transcript as context, so every connection has fresh keys."""
    prk = hmac.new(nonce_c + nonce_s, secret, hashlib.sha256).digest()
    info = b"kvferry/3 session keys" + hashlib.sha256(transcript).digest()
    okm, block = b"", b""
    for i in range(1, 3):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:KEY_BYTES], okm[KEY_BYTES:2 * KEY_BYTES]


class Direction:
    """One direction of a connection: its key, its sequence number, its mode.

    The sender's and the receiver's ``Direction`` for the same bytes hold the same key and count
    the same messages, each on its own side.
    """

    def __init__(self, key: bytes, encrypt: bool):
        self._aead = AESGCM(key)
        self._key = key
        self.encrypt = encrypt
        self.seq = 0
        self._nh: dict[Any, Any] = {}  # device -> NH key words

    def next(self) -> int:
        """The next message's sequence number (each message takes one, in order)."""
        seq = self.seq
        self.seq += 1
        return seq

    # ---- tags --------------------------------------------------------------------------------
    def header_tag(self, seq: int, header: bytes, payload_tag: bytes) -> bytes:
        return self._aead.encrypt(_NONCE.pack(seq, _HEADER), b"", header + payload_tag)

    def payload_tag(self, seq: int, payload: Any) -> bytes:
        """GMAC of host bytes (anything with the buffer protocol)."""
        return self._aead.encrypt(_NONCE.pack(seq, _PAYLOAD), b"", payload)

    def digest_tag(self, seq: int, digest: bytes) -> bytes:
        return self._aead.encrypt(_NONCE.pack(seq, _DIGEST), b"", digest)

    def check_header(self, seq: int, header: bytes, payload_tag: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.header_tag(seq, header, payload_tag), tag)

    def check_payload(self, seq: int, payload: Any, tag: bytes) -> bool:
        return hmac.compare_digest(self.payload_tag(seq, payload), tag)

    def check_digest(self, seq: int, digest: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.digest_tag(seq, digest), tag)

    # ---- encryption --------------------------------------------------------------------------
    def seal(self, seq: int, payload: Any) -> tuple[memoryview, bytes]:
        """(ciphertext, tag) of host bytes."""
        out = bytearray(len(payload) + TAG_BYTES)
        self._aead.encrypt_into(_NONCE.pack(seq, _PAYLOAD), payload, None, out)
        view = memoryview(out)
        return view[:-TAG_BYTES], bytes(view[-TAG_BYTES:])

    def open_into(self, seq: int, ciphertext: Any, tag: bytes, out: Any) -> bool:
        """Decrypt ``ciphertext`` into ``out`` (host bytes of the same length); False, and ``out``
        left undefined, if it fails its tag."""
        from cryptography.exceptions import InvalidTag

        try:
            self._aead.decrypt_into(_NONCE.pack(seq, _PAYLOAD), bytes(ciphertext) + tag, None, out)
        except InvalidTag:
            return False
        return True

    # ---- device digests ----------------------------------------------------------------------
    def nh_key(self, device: Any) -> Any:
        """This direction's NH key words (int64 tensor on ``device``), derived once per device."""
        import torch

        key = self._nh.get(str(device))
        if key is None:
            raw = hashlib.shake_256(b"kvferry/3 nh key" + self._key).digest(4 * _NH_KEY_WORDS)
            words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
            key = self._nh[str(device)] = _Key((words.to(torch.int64) & _MASK).to(device), words.to(device))
        return key

    def digest(self, payload: Any) -> Digest:
        """Launch ``device_digest`` of a payload (a uint8 tensor, CUDA or CPU, or host bytes)
        under this direction's key, where the payload is."""
        if not hasattr(payload, "is_cuda"):
            payload = host_tensor(payload)
        return Digest(payload, self.nh_key(payload.device))


class _Key:
    """NH key words: as int64 (the torch reference's arithmetic) and as the 32-bit words the
    kernel reads."""

    def __init__(self, wide: Any, words: Any):
        self.wide, self.words = wide, words

    def __getitem__(self, index: Any) -> Any:
        return self.wide[index]

    def numpy(self) -> Any:
        return self.wide.cpu().numpy()


def device_digest(payload: Any, key: Any) -> Any:
    """The NH digest of a uint8 tensor (CUDA or CPU: the same value from the same bytes): per
    64 KiB segment (the last one zero-padded), two 64-bit sums
    ``Σ ((w[2i] + k[2i + 4t]) mod 2^32) · ((w[2i+1] + k[2i+1 + 4t]) mod 2^32) mod 2^64``, t = 0, 1,
    over its little-endian 32-bit words ``w``. Returns an int64 tensor of shape (segments, 2)
    on the payload's device (the payload's length is authenticated with its header)."""
    import torch

    n = payload.numel()
    if payload.is_cuda and isinstance(key, _Key) and _kernel_usable(payload):
        return _digest_kernel(payload, key.words)
    if payload.storage_offset() % 4:
        payload = payload.clone()  # 32-bit words need an aligned start
    full = n // SEGMENT_BYTES
    parts = []
    for start in range(0, full, _SLICE_SEGMENTS):
        count = min(_SLICE_SEGMENTS, full - start)
        piece = payload[start * SEGMENT_BYTES:(start + count) * SEGMENT_BYTES]
        parts.append(_nh(piece.view(torch.int32).view(count, _SEGMENT_WORDS), key))
    if n % SEGMENT_BYTES or n == 0:
        tail = torch.zeros(SEGMENT_BYTES, dtype=torch.uint8, device=payload.device)
        tail[:n - full * SEGMENT_BYTES] = payload[full * SEGMENT_BYTES:]
        parts.append(_nh(tail.view(torch.int32).view(1, _SEGMENT_WORDS), key))
    return torch.cat(parts)


def _kernel_usable(payload: Any) -> bool:
    if payload.data_ptr() % 8 or not payload.is_contiguous():
        return False
    try:
        import cupy  # noqa: F401  (a probe)
    except ImportError:
        return False
    return True


def _digest_kernel(payload: Any, words: Any) -> Any:
    """``device_digest`` by one kernel on the payload's current stream: a warp per segment, each
    lane eight bytes at a time (coalesced), the sums reduced across the warp. The same value as
    the torch reference (tests compare them on the GPU)."""
    import cupy
    import numpy as np
    import torch

    n = payload.numel()
    segments = max(1, -(-n // SEGMENT_BYTES))
    device = payload.device.index if payload.device.index is not None else torch.cuda.current_device()
    out = torch.empty((segments, 2), dtype=torch.int64, device=payload.device)
    handle = torch._C._cuda_getCurrentRawStream(device)
    with cupy.cuda.Device(device), _external_stream(handle, device):
        _kernel(device)((min(-(-segments // _WARPS), 132 * 16),), (32 * _WARPS,),
                        (np.uint64(payload.data_ptr()), np.uint64(n), np.uint64(words.data_ptr()),
                         np.uint64(segments), np.uint64(out.data_ptr())))
    return out


_WARPS = 8


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int, device: int) -> Any:
    """torch's stream ``handle`` as CuPy's (kernels launch on CuPy's current stream)."""
    import warnings

    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device)


@functools.lru_cache(maxsize=None)
def _kernel(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawKernel(_SOURCE, "nh_digest")


_SOURCE = r"""
extern "C" __global__ void nh_digest(const unsigned char* data, unsigned long long n,
                                     const unsigned int* key, unsigned long long segments,
                                     unsigned long long* out) {
    const int lane = threadIdx.x & 31;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x >> 5);
    for (unsigned long long seg = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         seg < segments; seg += warps) {
        const unsigned long long base = seg * 65536ULL;
        unsigned long long s0 = 0, s1 = 0;
        for (int p = lane; p < 8192; p += 32) {
            const unsigned long long at = base + (unsigned long long)p * 8ULL;
            unsigned int w0 = 0, w1 = 0;
            if (at + 8ULL <= n) {
                const uint2 v = __ldg((const uint2*)(data + at));
                w0 = v.x;
                w1 = v.y;
            } else {  // past the end: zeros, as the reference pads
                for (int b = 0; b < 8; ++b) {
                    const unsigned int byte = at + b < n ? data[at + b] : 0u;
                    if (b < 4) w0 |= byte << (8 * b); else w1 |= byte << (8 * (b - 4));
                }
            }
            s0 += (unsigned long long)(w0 + __ldg(key + 2 * p)) * (unsigned long long)(w1 + __ldg(key + 2 * p + 1));
            s1 += (unsigned long long)(w0 + __ldg(key + 2 * p + 4)) * (unsigned long long)(w1 + __ldg(key + 2 * p + 5));
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            s0 += __shfl_down_sync(0xFFFFFFFFu, s0, offset);
            s1 += __shfl_down_sync(0xFFFFFFFFu, s1, offset);
        }
        if (lane == 0) {
            out[2 * seg] = s0;
            out[2 * seg + 1] = s1;
        }
    }
}
"""


def _nh(words: Any, key: Any) -> Any:
    import torch

    w = words.to(torch.int64) & _MASK
    sums = []
    for shift in (0, 4):
        k = key[shift:shift + _SEGMENT_WORDS]
        a = (w[:, 0::2] + k[0::2]) & _MASK
        b = (w[:, 1::2] + k[1::2]) & _MASK
        sums.append((a * b).sum(dim=1))  # int64 arithmetic wraps: mod 2^64
    return torch.stack(sums, dim=1)


class Digest:
    """A device digest being computed on the payload's stream: ``ready()`` asks without
    waiting, calling it gives the digest's bytes (waiting for the stream if need be)."""

    def __init__(self, payload: Any, key: Any):
        import torch

        digest = device_digest(payload, key)
        if payload.is_cuda:
            # Copied by torch into pinned memory, which its allocator keeps until the copy ran.
            self._host = torch.empty(digest.shape, dtype=digest.dtype, pin_memory=True)
            self._host.copy_(digest, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(payload.device))
        else:
            self._host, self._event = digest, None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def __call__(self) -> bytes:
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy().tobytes()


def host_tensor(data: Any) -> Any:
    """A uint8 CPU tensor over host bytes (no copy), for ``device_digest``."""
    import torch

    view = memoryview(data).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
