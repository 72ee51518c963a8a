"""Session keys and message seals: golden values (the layout's one home is ``seal.py``), the
device digest against a reference written independently with numpy, and what a seal refuses."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest
import torch

from kvferry.transport import seal

KEY = bytes(range(32))


def test_session_keys_are_hkdf_sha256_golden():
    c2s, s2c = seal.derive(b"secret", bytes(32), bytes([1]) * 32, b"transcript")
    prk = hmac.new(bytes(32) + bytes([1]) * 32, b"secret", hashlib.sha256).digest()
    info = b"kvferry/3 session keys" + hashlib.sha256(b"transcript").digest()
    t1 = hmac.new(prk, info + b"\x01", hashlib.sha256).digest()
    t2 = hmac.new(prk, t1 + info + b"\x02", hashlib.sha256).digest()
    assert (c2s, s2c) == (t1, t2) and c2s != s2c
    assert seal.derive(b"secret", bytes(32), bytes([2]) * 32, b"transcript")[0] != c2s  # fresh per nonce


def test_tags_are_gmac_keyed_by_sequence_and_part():
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    d = seal.Direction(KEY, encrypt=False)
    nonce = (5).to_bytes(8, "little") + b"\x01" + bytes(3)
    assert d.payload_tag(5, b"abc") == AESGCM(KEY).encrypt(nonce, b"", b"abc")
    assert d.payload_tag(5, b"abc") != d.payload_tag(6, b"abc")  # a replay under another number fails
    assert d.header_tag(5, bytes(48), bytes(16)) != d.payload_tag(5, bytes(64))  # parts never share a nonce
    assert d.check_payload(5, b"abc", d.payload_tag(5, b"abc")) and not d.check_payload(5, b"abd", d.payload_tag(5, b"abc"))


def test_encryption_round_trips_and_refuses_a_flipped_bit():
    d = seal.Direction(KEY, encrypt=True)
    plain = bytes(range(256)) * 5
    ciphertext, tag = d.seal(9, plain)
    assert bytes(ciphertext) != plain and len(ciphertext) == len(plain)
    out = bytearray(len(plain))
    assert d.open_into(9, ciphertext, tag, out) and bytes(out) == plain
    damaged = bytearray(ciphertext)
    damaged[100] ^= 1
    assert not d.open_into(9, damaged, tag, bytearray(len(plain)))
    assert not d.open_into(10, ciphertext, tag, bytearray(len(plain)))


def _nh_reference(data: bytes, key_words: np.ndarray) -> np.ndarray:
    """NH written again with numpy's unsigned arithmetic (defined to wrap mod 2^64)."""
    segment = seal.SEGMENT_BYTES
    padded = data + bytes(-len(data) % segment if data else segment)
    words = np.frombuffer(padded, dtype="<u4").astype(np.uint64).reshape(-1, segment // 4)
    out = []
    for shift in (0, 4):
        k = key_words[shift:shift + segment // 4].astype(np.uint64)
        a = (words[:, 0::2] + k[0::2]) & np.uint64(0xFFFFFFFF)
        b = (words[:, 1::2] + k[1::2]) & np.uint64(0xFFFFFFFF)
        out.append((a * b).sum(axis=1, dtype=np.uint64))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("size", [0, 1, 4095, seal.SEGMENT_BYTES, 3 * seal.SEGMENT_BYTES + 17])
def test_device_digest_matches_an_independent_reference(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    if size > 8:  # the largest words make the products and sums wrap
        data = b"\xff" * 8 + data[8:]
    d = seal.Direction(KEY, encrypt=False)
    key = d.nh_key("cpu")
    got = seal.device_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else
                             torch.empty(0, dtype=torch.uint8), key)
    want = _nh_reference(data, key.numpy().astype(np.uint64))
    assert np.array_equal(got.numpy().view(np.uint64), want)


def test_a_digest_changes_with_any_byte_and_with_an_unaligned_start():
    d = seal.Direction(KEY, encrypt=False)
    data = bytearray(np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    base = d.digest(bytes(data))()
    for position in (0, 65535, 65536, 199_999):
        data[position] ^= 0x10
        assert d.digest(bytes(data))() != base
        data[position] ^= 0x10
    shifted = torch.frombuffer(bytearray(b"x" + bytes(data)), dtype=torch.uint8)[1:]
    assert d.digest(shifted)() == base


@pytest.mark.gpu
@pytest.mark.parametrize("size", [0, 5, seal.SEGMENT_BYTES, 5 * seal.SEGMENT_BYTES + 3, 3 << 20])
@pytest.mark.parametrize("start", [0, 1, 8])
def test_gpu_digest_equals_the_cpu_digest(size, start):
    """The kernel (aligned starts) and the torch path (unaligned ones) against the CPU's value."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    d = seal.Direction(KEY, encrypt=False)
    data = torch.randint(0, 256, (start + size,), dtype=torch.uint8)
    data[start:start + 8] = 255
    gpu = data.cuda()[start:]
    assert d.digest(gpu)() == d.digest(data[start:].clone())()
