"""The CUDA decode of tca-tbe (``tcatbe_cuda.cu``) on the CPU: its per-byte, per-lane and header
functions compiled as plain C++ and run lane by lane, in the kernel's order, against the numpy
reference and ``format.parse_header``. Lanes share nothing, so this is the kernel's arithmetic
exactly (the launches and the check kernel are the GPU tests' part). Skipped without a C++
compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvferry.codec import CorruptFrame
from kvferry.codec.tcatbe import cuda
from kvferry.codec.tcatbe.codec import encode_reference, read_header
from kvferry.codec.tcatbe.format import FRAME_ID, HEADER_SIZE, padding_ranges, parse_header
from tests.codec.tcatbe_kernel_checks import inputs

_WRAPPER = r"""
extern "C" void host_decode(const u8* frame, const u64* offsets, u64 n, u32 window_low, u16* out,
                            const i64* block_ids, u64 block_elems, u64 block_stride, u32 runs) {
    u32 wide = window_low * 0x01010101u;
    const u64* bitmaps = (const u64*)(frame + offsets[0]);
    const u64* groups = (const u64*)(frame + offsets[1]);
    const u16* tiles = (const u16*)(frame + offsets[2]);
    const u8* signman = frame + offsets[3];
    const u16* fallback = (const u16*)(frame + offsets[4]);
    u64 span = (u64)runs * THREADS, nbytes = (n + 7) / 8;
    for (u64 base = 0; base < nbytes; base += span) {
        Span sp = make_span(bitmaps, groups, tiles, signman, fallback, n, base >> 3);
        for (u32 lane = 0; lane < THREADS; ++lane) {
            if (block_ids) decode_span<true>(wide, sp, out, block_ids, block_elems, block_stride, base, lane, runs);
            else decode_span<false>(wide, sp, out, block_ids, block_elems, block_stride, base, lane, runs);
        }
    }
}

extern "C" int host_parse_header(const u8* frame, u64 frame_size, u64 n, u32 expected_ndim, const u64* expected,
                                 u32 crc_verified, u64* params) {
    static u32 crc_table[4 * 256];
    for (u32 e = 0; e < 256; ++e) crc_entry(crc_table, e);
    for (u32 k = 1; k < 4; ++k)
        for (u32 e = 0; e < 256; ++e) crc_extend(crc_table, k, e);
    u32 words[HEADER_SIZE / 4] = {0};
    if (frame_size >= HEADER_SIZE) memcpy(words, frame, HEADER_SIZE);
    return parse_header(words, crc_table, frame_size, n, 1, expected_ndim, expected, crc_verified, params);
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("tcatbe_cuda") / "host_decode.so"
    source = f'#include <string.h>\n#include "{cuda._SOURCE}"\n{_WRAPPER}'
    build = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-x", "c++", "-", "-o", str(out)],
                           input=source, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def host_decode(library):
    fn = library.host_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32]
    return fn


@pytest.fixture(scope="module")
def host_parse_header(library):
    fn = library.host_parse_header
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32,
                   ctypes.c_void_p]
    return fn


def _decode(fn, frame: torch.Tensor, out: np.ndarray, ids: np.ndarray | None = None, block_elems: int = 0,
            block_stride: int = 0, runs: int = 8) -> None:
    header = read_header(frame)
    buf = np.zeros(frame.numel() + 16, dtype=np.uint8)  # 16 spare bytes: words past the end are read whole
    buf[:frame.numel()] = frame.numpy()
    offsets = np.array(header.offsets, dtype=np.uint64)
    fn(buf.ctypes.data, offsets.ctypes.data, header.numel, header.window_low, out.ctypes.data,
       None if ids is None else ids.ctypes.data, block_elems, block_stride, runs)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.reshape(-1).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("runs", [8, 4, 1, 32])
def test_host_build_decodes_every_input_bit_exactly(host_decode, runs):
    for name, x in inputs().items():
        frame = encode_reference(x, checksum=False)
        if frame[6].item() != FRAME_ID or not x.numel():
            continue
        out = np.full(x.numel(), 0x5A5A, dtype=np.uint16)
        _decode(host_decode, frame, out, runs=runs)
        assert np.array_equal(out, _bits(x)), name


@pytest.mark.parametrize("runs", [1, 8])
@pytest.mark.parametrize("block_elems", [128, 2048 + 64, 13471 * 8])
def test_host_build_decodes_into_scattered_blocks(host_decode, block_elems, runs):
    flat = inputs()["patterns_in_kv"].reshape(-1)
    count = flat.numel() // block_elems
    x = flat[:count * block_elems].reshape(count, block_elems)
    frame = encode_reference(x, checksum=False)
    assert frame[6].item() == FRAME_ID
    rng = np.random.default_rng(block_elems)
    ids = rng.permutation(count + 7)[:count].astype(np.int64)
    stride = block_elems + 8  # rows apart by more than a block: the kernel takes the stride
    cache = np.full((count + 7) * stride, 0x5A5A, dtype=np.uint16)
    _decode(host_decode, frame, cache, ids, block_elems, stride, runs=runs)
    rows = cache.reshape(count + 7, stride)
    assert np.array_equal(rows[ids, :block_elems], _bits(x).reshape(count, block_elems))
    untouched = np.ones(count + 7, dtype=bool)
    untouched[ids] = False
    assert (rows[untouched] == 0x5A5A).all() and (rows[:, block_elems:] == 0x5A5A).all()


def _device_header(fn, frame: np.ndarray, n: int, shape: tuple[int, ...] | None = None,
                   crc_verified: bool = False) -> np.ndarray | None:
    """The device header check's parameters for ``frame`` (None where it declines the frame)."""
    expected = np.zeros(8, dtype=np.uint64)
    expected[:len(shape or ())] = shape or ()
    params = np.zeros(cuda.P_WORDS, dtype=np.uint64)
    buf = np.zeros(max(frame.size, HEADER_SIZE), dtype=np.uint8)
    buf[:frame.size] = frame
    ok = fn(buf.ctypes.data, frame.size, n, 255 if shape is None else len(shape), expected.ctypes.data,
            int(crc_verified), params.ctypes.data)
    return params if ok else None


def _host_header(frame: np.ndarray):
    try:
        return parse_header(frame.tobytes(), frame.size, frozenset({1}))
    except CorruptFrame:
        return None


def test_device_header_check_agrees_with_parse_header(host_parse_header):
    """Every single-bit flip and every rewritten field of a header is accepted by the header
    kernel's check exactly when parse_header accepts it, with the same stream offsets and gaps."""
    x = inputs()["patterns_in_kv"]
    frames = {crc: encode_reference(x, checksum=crc).numpy() for crc in (False, True)}
    cases = []
    for crc, frame in frames.items():
        cases.append((frame, crc))
        for i in range(HEADER_SIZE * 8):
            bad = frame.copy()
            bad[i // 8] ^= 1 << (i % 8)
            cases.append((bad, crc))
        for cut in (0, 50, HEADER_SIZE - 1, HEADER_SIZE, frame.size - 1):
            cases.append((frame[:cut].copy(), crc))
        cases.append((np.concatenate([frame, np.zeros(16, np.uint8)]), crc))
    accepted = 0
    for frame, crc in cases:
        host = _host_header(frame)
        for verified in (False, True):
            params = _device_header(host_parse_header, frame, x.numel(), crc_verified=verified)
            expect = host is not None and (host.stream_crc is None or verified)
            assert (params is not None) == expect
            if params is None:
                continue
            accepted += 1
            gaps = [v for r in padding_ranges(host) for v in r]
            assert list(params[:5]) == list(host.offsets)
            assert list(params[5:9]) == [host.numel, host.tiles, host.in_window, host.window_low]
            assert list(params[9:]) == gaps + [0] * (8 - len(gaps))
    assert accepted == 3
    frame = frames[False]
    assert _device_header(host_parse_header, frame, x.numel() - 8) is None  # another element count
    assert _device_header(host_parse_header, frame, x.numel(), tuple(x.shape)) is not None
    assert _device_header(host_parse_header, frame, x.numel(), (x.shape[0] // 2, 16)) is None
    assert _device_header(host_parse_header, frame, x.numel(), (x.numel(),)) is None


def test_device_header_check_on_rewritten_fields(host_parse_header):
    """Fields rewritten with a valid header CRC (what a bit flip test cannot reach): the same
    verdicts as parse_header."""
    import struct

    from kvferry.codec.checksum import crc32c

    x = inputs()["specials"]
    frame = encode_reference(x, checksum=False).numpy()
    header = read_header(torch.from_numpy(frame))
    fields = [(4, "<H", 2), (6, "<B", 7), (7, "<B", 2), (8, "<B", 9), (8, "<B", 1), (8, "<B", 3), (9, "<B", 250),
              (9, "<B", 249), (10, "<B", 1), (10, "<B", 2), (11, "<B", 1), (12, "<Q", 2 ** 64 - 1), (20, "<Q", 0),
              (20, "<Q", 2 ** 63), (28, "<Q", 2 ** 62), (36, "<Q", 1), (84, "<Q", header.in_window - 16),
              (84, "<Q", 2 ** 64 - 1), (92, "<Q", 2 ** 64 - 1), (100, "<I", 1), (104, "<I", 7)]
    for offset, fmt, value in fields:
        buf = bytearray(frame.tobytes())
        struct.pack_into(fmt, buf, offset, value)
        struct.pack_into("<I", buf, 108, crc32c(bytes(buf[:108])))
        bad = np.frombuffer(bytes(buf), dtype=np.uint8)
        host = _host_header(bad)
        for verified in (False, True):
            params = _device_header(host_parse_header, bad, x.numel(), crc_verified=verified)
            assert (params is not None) == (host is not None and (host.stream_crc is None or verified)), (offset, value)


def test_stream_places_from_the_element_count(host_parse_header):
    """The check kernel takes GROUPS' and TILES' offsets from the host (``cuda._leading``) and the
    host declines a frame shorter than TILES' end without a launch: the offsets are the header's
    for every accepted frame, and the header check accepts no frame shorter than that end."""
    checked = 0
    for name, x in inputs().items():
        frame = encode_reference(x, checksum=False)
        if frame[6].item() != FRAME_ID or not x.numel():
            continue
        header = read_header(frame)
        groups, tiles_at, end = cuda._leading(x.numel())
        assert (groups, tiles_at, end) == (header.offsets[1], header.offsets[2],
                                           header.offsets[2] + header.lengths[2]), name
        assert header.offsets[0] == HEADER_SIZE and end <= frame.numel(), name
        buf = frame.numpy()
        for cut in {end - 1, end - 16, HEADER_SIZE}:
            assert _device_header(host_parse_header, buf[:cut].copy(), x.numel()) is None, (name, cut)
        checked += 1
    assert checked >= 3
