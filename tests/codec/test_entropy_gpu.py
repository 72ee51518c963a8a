"""The entropy codec's GPU kernels against the CPU reference, byte for byte, both ways.
Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from kvferry.codec import entropy
from kvferry.codec.entropy import gpu
from kvferry.codec.entropy.codec import encode_reference
from kvferry.codec.entropy.format import Stream
from kvferry.codec.entropy.huffman import code_tables
from tests.codec.test_entropy_roundtrip import kv_like, stored_chunks, with_specials
from tests.conftest import DTYPES, bits_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and CuPy")]


def _both_ways(x: torch.Tensor, book, chunk: int = entropy.DEFAULT_CHUNK, checksum: bool = True) -> torch.Tensor:
    cpu = encode_reference(x, book, checksum=checksum, chunk=chunk)
    dev = entropy.encode(x.cuda(), book, checksum=checksum, chunk=chunk)
    assert dev.is_cuda and torch.equal(dev.cpu(), cpu), "GPU frame != CPU frame"
    y = entropy.decode(cpu.cuda())
    assert y.is_cuda and bits_equal(y.cpu(), x)
    return cpu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_bytes_equal_cpu_bytes(dtype):
    book = entropy.calibrate(kv_like((4, 256, 32), dtype, seed=1), token_axis=1, tables=8)
    for n_tokens, chunk, coded in ((512, 2048, True), (300, 32768, True), (17, 64, False)):
        x = with_specials(kv_like((4, n_tokens, 32), dtype, seed=2), seed=3)
        frame = _both_ways(x, book, chunk)
        assert frame[6].item() == (entropy.FRAME_ID if coded else codec.FrameCodec.STORED)
    # Every bit pattern among KV-like data: escapes and stored chunks on both paths.
    width = torch.empty((), dtype=dtype).element_size()
    ints = torch.arange(1 << (8 * width), dtype=torch.int32)
    patterns = (ints.to(torch.int16) if width == 2 else ints.to(torch.uint8)).repeat(16 if width == 1 else 1)
    kv = kv_like((8, 256, 32), dtype, seed=10).reshape(-1).view(torch.uint8)
    x = torch.cat([kv, patterns.view(torch.uint8), kv]).view(dtype)
    frame = _both_ways(x, book, 1024)
    assert stored_chunks(frame) > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_real_kv(dtype, real_kv):
    calib = torch.stack(real_kv["c0_k"]).to(dtype)
    data = torch.stack(real_kv["c1_k"]).to(dtype)
    book = entropy.calibrate(calib, token_axis=2)
    _both_ways(data, book)


def test_gpu_corruption_raises_and_writes_nothing():
    x = with_specials(kv_like((4, 256, 32), torch.bfloat16, seed=4), seed=5)
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=6), token_axis=1, tables=4)
    for checksum in (True, False):
        frame = entropy.encode(x.cuda(), book, checksum=checksum, chunk=4096)
        h = entropy.read_header(frame)
        positions = [10, h.offsets[Stream.COUNTS]]
        if checksum:  # unchecksummed, a flipped word bit can decode to other symbols (test_entropy_corruption)
            positions += [h.offsets[Stream.WORDS] + 1, h.offsets[Stream.WORDS] + 3]
        for pos in positions:
            bad = frame.clone()
            bad[pos] ^= 0x04
            out = torch.zeros_like(x).cuda()
            with pytest.raises(codec.CorruptFrame):
                entropy.decode(bad, out=out)
            assert not out.view(torch.int16).any()
            with pytest.raises(codec.CorruptFrame):
                entropy.decode(bad.cpu())


def test_gpu_blocks():
    dtype = torch.float8_e4m3fn
    cache = kv_like((12, 4, 256, 32), dtype, seed=8).cuda()
    book = entropy.calibrate([cache[i].cpu() for i in range(3)], token_axis=1, tables=8)
    ids = torch.tensor([7, 2, 9, 4], device="cuda")
    frame = entropy.encode_blocks(cache, ids, book)
    assert torch.equal(frame.cpu(), entropy.encode_blocks(cache.cpu(), ids.cpu(), book))
    dst = torch.zeros_like(cache.view(torch.uint8))
    entropy.decode_blocks(frame, dst.view(dtype), ids)
    assert torch.equal(dst[ids], cache.view(torch.uint8)[ids])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_gpu_block_period_tables_a_word_per_context(dtype):
    """A block's period of whole token rows (a codebook learned with the token axis) takes the
    coders' FAST = 2 builds, whose tables are a word per context: the CPU's bytes both ways."""
    cache = with_specials(kv_like((6, 2, 64, 512), dtype, seed=21), seed=22).cuda()
    book = entropy.calibrate_blocks(cache[:3], token_axis=1, tables=12)
    assert book.geometry.period > gpu.COMPACT_FROM
    assert gpu._tables_on(code_tables(book), torch.device("cuda")).p4 == (15, 9)
    ids = torch.tensor([5, 0, 3, 1], device="cuda")
    frame = entropy.encode_blocks(cache, ids, book, chunk=4096)
    assert torch.equal(frame.cpu(), entropy.encode_blocks(cache.cpu(), ids.cpu(), book, chunk=4096))
    dst = torch.zeros_like(cache.view(torch.uint8))
    entropy.decode_blocks(frame, dst.view(dtype), ids)
    assert torch.equal(dst[ids], cache.view(torch.uint8)[ids])
    _both_ways(cache[2:5].cpu(), book, chunk=8192, checksum=False)


def test_gpu_generic_kernels():
    """A period under 32 elements takes the kernels' step-by-step tables (no per-position table)."""
    for dtype in DTYPES:
        book = entropy.calibrate(list(kv_like((64, 2, 8), dtype, seed=11)), token_axis=1, tables=4)
        assert book.geometry.period < 32
        x = with_specials(kv_like((40, 2, 8), dtype, seed=12), seed=13)
        for chunk in (64, 1024):
            _both_ways(x, book, chunk, checksum=False)


def test_gpu_tables_in_global_memory():
    """Tables too many for shared memory take the coders' builds that read them from global memory."""
    book = entropy.calibrate(kv_like((4, 64, 256), torch.bfloat16, seed=15), token_axis=1, tables=200)
    assert gpu._tables_on(code_tables(book), torch.device("cuda")).dec_smem == 0, book.tables
    x = with_specials(kv_like((4, 300, 256), torch.bfloat16, seed=16), seed=17)
    for chunk in (4096, 32768):
        _both_ways(x, book, chunk, checksum=False)


@pytest.mark.parametrize("shape", [(12, 3, 20, 8), (12, 500, 7)], ids=["whole-steps", "partial-steps"])
def test_gpu_blocks_bf16(shape):
    """Blocks of whole 32-element steps are read and written in place; others go through copies."""
    cache = kv_like(shape, torch.bfloat16, seed=14).cuda()
    book = entropy.calibrate([cache[i].cpu() for i in range(3)], token_axis=None if len(shape) == 3 else 1, tables=8)
    ids = torch.tensor([7, 2, 9, 4, 0, 11], device="cuda")
    frame = entropy.encode_blocks(cache, ids, book, checksum=False)
    assert frame[6].item() == entropy.FRAME_ID
    assert torch.equal(frame.cpu(), entropy.encode_blocks(cache.cpu(), ids.cpu(), book, checksum=False))
    dst = torch.zeros_like(cache)
    entropy.decode_blocks(frame, dst, ids)
    assert torch.equal(dst[ids].view(torch.int16), cache[ids].view(torch.int16))
    assert not dst.view(torch.int16)[[1, 3, 5, 6, 8, 10]].any()
    bad = frame.clone()
    bad[entropy.read_header(frame).offsets[Stream.COUNTS]] ^= 0x10  # a chunk's word count
    before = dst.clone()
    with pytest.raises(codec.CorruptFrame):
        entropy.decode_blocks(bad, dst, ids)
    assert torch.equal(dst.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_calibration_counts_on_the_gpu_as_on_the_cpu(dtype):
    """A codebook learned from GPU samples (counted there) is the one their host copies give."""
    x = with_specials(kv_like((4, 256, 32), dtype, seed=18), seed=19)
    on_gpu = entropy.calibrate(x.cuda(), token_axis=1, tables=8)
    assert on_gpu.to_json() == entropy.calibrate(x, token_axis=1, tables=8).to_json()


def test_a_codebook_learned_on_the_gpu_comes_with_its_tables_there():
    """``learn`` (an engine's thread) builds the GPU's tables, so the first transfer with the
    codebook does not build them on the event loop; frames are the CPU's bytes."""
    cache = kv_like((6, 2, 16, 256), torch.bfloat16, seed=31).cuda()
    book = codec.get("entropy").learn(cache[:4], codec.BlockLayout((2, 16, 256), ("kv", "token", "channel")))
    ct = code_tables(book)
    assert ("gpu", "cuda:0") in ct._cache
    ids = torch.tensor([5, 1, 3], device="cuda")
    frame = entropy.encode_blocks(cache, ids, book)
    assert torch.equal(frame.cpu(), entropy.encode_blocks(cache.cpu(), ids.cpu(), book))


def test_gpu_frames_of_fewer_elements_than_their_period():
    """A period longer than a frame (a codebook learned on more blocks than a transfer holds,
    or calibrated on a whole layer; or one a header names): the device decodes with tables of
    the positions the frame's elements reach, the CPU's bytes both ways."""
    from tests.codec.test_entropy_corruption import _forge

    cache = kv_like((16, 8192), torch.bfloat16, seed=31).cuda()
    book = codec.get("entropy").learn(cache[:8], None)
    assert book.geometry.period == 8 * 8192
    ids = torch.tensor([11, 3], device="cuda")
    frame = entropy.encode_blocks(cache, ids, book, checksum=False)
    assert torch.equal(frame.cpu(), entropy.encode_blocks(cache.cpu(), ids.cpu(), book, checksum=False))
    dst = torch.zeros_like(cache)
    entropy.decode_blocks(frame, dst, ids)
    assert bits_equal(dst[ids], cache[ids]) and not dst[[0, 1, 2, 4]].view(torch.int16).any()
    layer = entropy.calibrate(kv_like((3, 80, 64), torch.bfloat16, seed=32), token_axis=1, tables=6)
    for tokens in (30, 79):
        _both_ways(kv_like((3, tokens, 64), torch.bfloat16, seed=tokens), layer, 1024, checksum=False)
    x = kv_like((64, 32), torch.bfloat16, seed=21)
    by_channel = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=1), token_axis=None, tables=2)
    forged = _forge(entropy.encode(x, by_channel, checksum=False, chunk=4096), tokens=1 << 22).cuda()
    assert bits_equal(entropy.decode(forged).cpu(), x)
    h = entropy.read_header(forged)
    prefix = forged[:h.offsets[Stream.COUNTS]].cpu().numpy()
    ct = gpu._frame_tables(h, prefix[h.offsets[Stream.TABLES]:][:h.lengths[Stream.TABLES]].tobytes(),
                           prefix[h.offsets[Stream.MAP]:][:h.lengths[Stream.MAP]].tobytes())
    assert h.geometry.period == 1 << 27 and gpu._tables_on(ct, forged.device).ptab.numel() <= 2 * h.numel
