"""The CUDA decode of tca-tbe (``tcatbe_cuda.cu``) on the CPU: its per-byte and per-lane functions
compiled as plain C++ and run lane by lane, in the kernel's order, against the numpy reference.
Lanes share nothing but the tables, so this is the kernel's arithmetic exactly (the launch and the
check kernel are the GPU tests' part). Skipped without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvferry.codec.tcatbe import cuda
from kvferry.codec.tcatbe.codec import encode_reference, read_header
from kvferry.codec.tcatbe.format import FRAME_ID
from tests.codec.tcatbe_kernel_checks import inputs

_WRAPPER = r"""
extern "C" void host_decode(const u8* frame, const u64* offsets, u64 n, u32 window_low, u16* out,
                            const i64* block_ids, u64 block_elems, u64 block_stride, u32 runs) {
    static Tables tb;
    for (u32 v = 0; v < 256; ++v) build_entry(&tb, v, window_low);
    const u64* bitmaps = (const u64*)(frame + offsets[0]);
    const u64* groups = (const u64*)(frame + offsets[1]);
    const u16* tiles = (const u16*)(frame + offsets[2]);
    const u8* signman = frame + offsets[3];
    const u16* fallback = (const u16*)(frame + offsets[4]);
    u64 span = (u64)runs * THREADS, nbytes = (n + 7) / 8;
    for (u64 base = 0; base < nbytes; base += span) {
        Span sp = make_span(bitmaps, groups, tiles, signman, fallback, n, base >> 3);
        for (u32 lane = 0; lane < THREADS; ++lane) {
            if (block_ids) decode_span<true>(tb, sp, out, block_ids, block_elems, block_stride, base, lane, runs);
            else decode_span<false>(tb, sp, out, block_ids, block_elems, block_stride, base, lane, runs);
        }
    }
}
"""


@pytest.fixture(scope="module")
def host_decode(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("tcatbe_cuda") / "host_decode.so"
    source = f'#include "{cuda._SOURCE}"\n{_WRAPPER}'
    build = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-x", "c++", "-", "-o", str(out)],
                           input=source, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    fn = ctypes.CDLL(str(out)).host_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32]
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
