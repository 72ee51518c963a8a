"""GPU kernels against the CPU reference, byte for byte. Skipped without CUDA and CuPy."""

from __future__ import annotations

import random

import pytest
import torch

from kvferry import codec
from kvferry.codec.splitzip import gpu as splitzip_gpu
from kvferry.codec.format import FrameCodec
from kvferry.codec.checksum import crc32c
from kvferry.codec.frames import _encode
from tests.conftest import DTYPES, bits_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not splitzip_gpu.available(), reason="needs a CUDA GPU and CuPy"),
]
SIZES = [0, 1, 7, 8, 9, 1023, 1024, 1025, 4096 + 3, 3 * 1024 * 37 + 5]


def _random_bits(n: int, dtype: torch.dtype, seed: int, escape_rate: float) -> torch.Tensor:
    """KV-like values with a fraction of fully random bit patterns (NaN, Inf, subnormal, ...)."""
    gen = torch.Generator().manual_seed(seed)
    bits = codec.layout_for(dtype).int_dtype  # masked writes lack float8 kernels
    x = torch.randn(n, generator=gen).to(dtype).view(bits)
    noise = torch.randint(0, 256, (n * x.element_size(),), dtype=torch.uint8, generator=gen).view(bits)
    mask = torch.rand(n, generator=gen) < escape_rate
    x[mask] = noise[mask]
    return x.view(dtype)


def _cpu_and_gpu(x: torch.Tensor, book, checksum=False) -> tuple[torch.Tensor, torch.Tensor]:
    return codec.encode(x, book, checksum=checksum), codec.encode(x.cuda(), book, checksum=checksum)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("escape_rate", [0.0, 0.01, 0.2])
def test_gpu_frame_bytes_equal_cpu(dtype, n, escape_rate):
    x = _random_bits(n, dtype, seed=n, escape_rate=escape_rate)
    book = codec.calibrate(torch.randn(5000).to(dtype))
    cpu, gpu = _cpu_and_gpu(x, book, checksum=n % 2 == 1)
    assert gpu.is_cuda
    assert torch.equal(cpu, gpu.cpu())
    assert bits_equal(codec.decode(gpu).cpu(), x)
    assert bits_equal(codec.decode(cpu.cuda()).cpu(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_self_calibrated_and_shaped(dtype):
    x = _random_bits(6 * 1000, dtype, seed=5, escape_rate=0.001).view(2, 3, 1000)
    cpu, gpu = codec.encode(x), codec.encode(x.cuda())
    assert torch.equal(cpu, gpu.cpu())
    y = codec.decode(gpu)
    assert y.shape == x.shape and y.is_cuda and bits_equal(y.cpu(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_pattern_on_gpu(dtype):
    layout = codec.layout_for(dtype)
    x = torch.arange(1 << layout.total_bits, dtype=torch.int32).to(layout.int_dtype).view(dtype)
    forced = _encode(x, None, checksum=False, chunk=1024, force=FrameCodec.SPLITZIP)
    assert bits_equal(codec.decode(forced.cuda()).cpu(), x)  # all-escape-ish coded frame on the GPU
    cpu, gpu = _cpu_and_gpu(x, None)
    assert torch.equal(cpu, gpu.cpu())


def test_real_kv_same_bytes_and_ratio(real_kv):
    book = codec.calibrate(real_kv["c0"])
    x = torch.cat([t.reshape(-1) for t in real_kv["c1"]])
    cpu, gpu = _cpu_and_gpu(x, book)
    assert torch.equal(cpu, gpu.cpu())
    assert x.numel() * 2 / gpu.numel() >= 1.32
    for dtype in (torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        y = x.to(dtype)
        b = codec.calibrate([t.to(dtype) for t in real_kv["c0"]])
        cpu, gpu = _cpu_and_gpu(y, b)
        assert torch.equal(cpu, gpu.cpu())


def test_decode_into_out_and_noncontiguous():
    x = _random_bits(5000, torch.bfloat16, seed=9, escape_rate=0.01).cuda()
    frame = codec.encode(x)
    out = torch.empty(5000, dtype=torch.bfloat16, device="cuda")
    assert codec.decode(frame, out=out) is out and bits_equal(out, x)
    base = torch.zeros(5000, 2, dtype=torch.bfloat16, device="cuda")
    codec.decode(frame, out=base[:, 0])
    assert torch.equal(base[:, 0].view(torch.int16), x.view(torch.int16))
    assert torch.count_nonzero(base[:, 1]) == 0
    odd = torch.empty(frame.numel() + 1, dtype=torch.uint8, device="cuda")[1:]  # misaligned frame
    odd.copy_(frame)
    assert bits_equal(codec.decode(odd), x)


@pytest.mark.parametrize("chunk", [512, 1024, 2048, 3072])
@pytest.mark.parametrize("n", [1, 1024, 6144, 3 * 3072 * 41 + 17])
def test_bf16_chunk_sizes_and_misaligned_out(chunk, n):
    """Chunks shorter and longer than a subgroup's pass, partial last chunks, escapes (and so
    the escape-offset scan across many tiles), and output that is only 2-byte aligned."""
    x = _random_bits(n, torch.bfloat16, seed=n + chunk, escape_rate=0.02)
    book = codec.calibrate(torch.randn(5000).to(torch.bfloat16))
    frame = codec.encode(x, book, chunk=chunk)
    assert codec.read_header(frame).codec == FrameCodec.SPLITZIP or n == 1
    assert torch.equal(codec.encode(x.cuda(), book, chunk=chunk).cpu(), frame)
    assert bits_equal(codec.decode(frame.cuda()).cpu(), x)
    shifted = torch.zeros(n + 1, dtype=torch.bfloat16, device="cuda")
    codec.decode(frame.cuda(), out=shifted[1:])
    assert bits_equal(shifted[1:].cpu(), x) and int(shifted[:1].view(torch.int16)) == 0


def test_corrupt_frames_raise_on_gpu():
    x = _random_bits(3 * 1024 + 11, torch.bfloat16, seed=2, escape_rate=0.02)
    base = codec.encode(x)
    header = codec.read_header(base)
    assert header.codec == FrameCodec.SPLITZIP
    escape_streams = header.offsets[2]
    rng = random.Random(5)
    raised = 0
    for _ in range(400):
        data = bytearray(base.numpy().tobytes())
        # half the damage lands in the escape streams, where it is detectable without a checksum
        first = escape_streams if rng.random() < 0.5 else codec.HEADER_SIZE
        start = rng.randrange(first, len(data))
        for j in range(start, min(len(data), start + rng.randint(1, 4))):
            data[j] = rng.randrange(256)
        frame = torch.frombuffer(data, dtype=torch.uint8).cuda()
        out = torch.full((x.numel(),), 7.0, dtype=torch.bfloat16, device="cuda")
        try:
            cpu_result = codec.decode(frame.cpu())
        except codec.CorruptFrame:
            with pytest.raises(codec.CorruptFrame):
                codec.decode(frame, out=out)
            assert bool((out == 7.0).all()), "GPU decode wrote before rejecting"
            raised += 1
            continue
        assert bits_equal(codec.decode(frame, out=out).cpu(), cpu_result)
    assert raised > 50


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocks_on_gpu(dtype):
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(64, 2, 16, 256, generator=gen).to(dtype)  # 16 KiB blocks in bf16
    ids = [63, 0, 17, 17, 5, 40]
    book = codec.calibrate(cache)
    gpu_cache = cache.cuda()
    frame = codec.encode_blocks(gpu_cache, ids, book)
    assert torch.equal(frame.cpu(), codec.encode(cache[ids], book))
    dst = torch.zeros_like(gpu_cache)
    slots = [3, 9, 1, 60, 33, 2]
    codec.decode_blocks(frame, dst, slots)
    assert bits_equal(dst[slots].cpu(), cache[ids])
    rest = [i for i in range(64) if i not in slots]
    assert int(torch.count_nonzero(dst[rest].view(torch.uint8))) == 0


@pytest.mark.parametrize("block_shape", [(2, 16, 256), (4, 8)], ids=["16KiB", "32-element"])
def test_block_ids_checked_on_gpu_write_nothing(block_shape):
    """The kernels check ids themselves (no host wait): bad ids anywhere in the list, in blocks
    larger and smaller than a chunk, raise and leave the destination untouched."""
    cache = torch.randn(64, *block_shape).to(torch.bfloat16).cuda()
    book = codec.calibrate(cache)
    good = list(range(0, 64, 2))
    for bad in ([*good, 64], [-1, *good], [*good[:7], 1 << 40, *good[7:]]):
        with pytest.raises(codec.BlockOutOfRange):
            codec.encode_blocks(cache, bad, book)
        out = torch.empty(codec.frame_capacity((len(bad), *block_shape), cache.dtype), dtype=torch.uint8, device="cuda")
        assert int(codec.encode_blocks_into(cache, bad, book, out)) == -1
    frame = codec.encode_blocks(cache, good, book)
    assert torch.equal(frame.cpu(), codec.encode(cache.cpu()[good], book))
    dst = torch.zeros_like(cache)
    for slots, error in (([*good[:-1], 64], IndexError), ([-3, *good[1:]], IndexError),
                         ([*good[:-1], good[0]], codec.OutputMismatch)):
        with pytest.raises(error):
            codec.decode_blocks(frame, dst, slots)
    assert int(torch.count_nonzero(dst.view(torch.uint8))) == 0
    codec.decode_blocks(frame, dst, good[::-1])
    assert bits_equal(dst[good[::-1]].cpu(), cache[good].cpu())


def test_blocks_with_odd_block_size_fall_back():
    cache = torch.randn(10, 3, 5).to(torch.bfloat16)  # 15 elements: not a multiple of 8
    frame = codec.encode_blocks(cache.cuda(), [4, 2])
    assert torch.equal(frame.cpu(), codec.encode(cache[[4, 2]], codec.calibrate(cache[[4, 2]])))


def test_runs_on_callers_stream():
    x = _random_bits(1 << 20, torch.bfloat16, seed=1, escape_rate=0.001).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    with torch.cuda.stream(stream):
        frame = codec.encode(x)
        y = codec.decode(frame)
    stream.synchronize()
    assert bits_equal(y, x)


def test_encode_into_queues_without_host_sync():
    xs = [_random_bits(70_000 + 8 * i, torch.bfloat16, seed=i, escape_rate=0.01 * i).cuda() for i in range(4)]
    book = codec.calibrate(xs[0])
    bufs = [torch.empty(codec.frame_capacity(x.shape, x.dtype), dtype=torch.uint8, device="cuda") for x in xs]
    codec.encode_into(xs[0], book, bufs[0])  # warm caches (kernels, tables) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lengths = [codec.encode_into(x, book, buf) for x, buf in zip(xs, bufs)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x, buf, length in zip(xs, bufs, lengths):
        assert torch.equal(buf[: int(length)].cpu(), codec.encode(x.cpu(), book))
    stored = torch.randint(0, 1 << 16, (5000,), dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    buf = torch.empty(codec.frame_capacity(stored.shape, stored.dtype), dtype=torch.uint8, device="cuda")
    length = codec.encode_into(stored, book, buf)  # random bits: the device picks a stored frame
    assert torch.equal(buf[: int(length)].cpu(), codec.encode(stored.cpu(), book))
    assert codec.read_header(buf[: int(length)]).codec == FrameCodec.STORED


def test_codec_in_a_fresh_thread():
    """Kernels launch through the driver API, which needs a context bound to the calling thread:
    a thread that has made no CUDA call yet must work too (the sidecar codes on worker threads)."""
    import threading

    x = _random_bits(70_000, torch.bfloat16, seed=3, escape_rate=0.01)
    results = {}

    def work() -> None:
        try:
            frame = codec.encode(x.cuda())
            results["frame"], results["y"] = frame.cpu(), codec.decode(frame).cpu()
        except Exception as error:  # reported by the assertion below
            results["error"] = error

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in results, results.get("error")
    assert torch.equal(results["frame"], codec.encode(x, codec.calibrate(x)))
    assert bits_equal(results["y"], x)


def test_strided_block_id_tensors():
    """Ids given as a strided CUDA view are read as the values they show, not as memory."""
    cache = torch.randn(32, 4096).to(torch.bfloat16)
    book = codec.calibrate(cache)
    every_other = torch.tensor([5, 0, 9, 0, 2, 0, 30, 0], device="cuda")[::2]
    frame = codec.encode_blocks(cache.cuda(), every_other, book)
    assert torch.equal(frame.cpu(), codec.encode(cache[[5, 9, 2, 30]], book))
    dst = torch.zeros_like(cache, device="cuda")
    codec.decode_blocks(frame, dst, torch.tensor([7, 0, 1, 0, 3, 0, 4, 0], device="cuda")[::2])
    assert bits_equal(dst[[7, 1, 3, 4]].cpu(), cache[[5, 9, 2, 30]])
    assert int(torch.count_nonzero(dst[[0, 2, 5, 6]].view(torch.int16))) == 0


def _with_header_crc(data: bytearray) -> bytearray:
    data[156:160] = crc32c(bytes(data[:156])).to_bytes(4, "little")
    return data


def _header_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn(3, 1100, generator=gen)
    kv[0, ::50] = 1e30  # escapes
    return [
        codec.encode(kv.to(torch.bfloat16)),
        codec.encode(kv.to(torch.bfloat16), checksum=True),
        codec.encode(kv.to(torch.float16)),
        codec.encode(kv.to(torch.float8_e5m2), chunk=512),
        _encode(kv.to(torch.float8_e4m3fn), None, checksum=False, chunk=64, force=FrameCodec.SPLITZIP),
        codec.encode(torch.randint(0, 256, (700,), dtype=torch.uint8).view(torch.float8_e4m3fn)),  # stored
    ]


def test_header_checked_on_the_device_agrees_with_the_host():
    """Single-bit changes (bits 0, 1, 4, 7) of every header byte, the header CRC made valid again so
    that the field checks themselves are reached: the GPU (which checks the header on the
    device) raises exactly when the CPU reference raises, the same error, and writes nothing
    then; otherwise both give the same bits."""
    checked = raised = 0
    for frame in _header_cases():
        header = codec.read_header(frame)
        original = bytearray(frame.numpy().tobytes())
        for byte in range(156):
            for bit in (0, 1, 4, 7):
                data = bytearray(original)
                data[byte] ^= 1 << bit
                data = _with_header_crc(data)
                cpu_frame = torch.frombuffer(data, dtype=torch.uint8)
                out = torch.full((header.numel,), 3.0).to(header.layout.dtype).cuda()
                try:
                    expected = codec.decode(cpu_frame, out=torch.empty(header.numel, dtype=header.layout.dtype))
                except (codec.CorruptFrame, codec.OutputMismatch) as error:
                    with pytest.raises(type(error)):
                        codec.decode(cpu_frame.cuda(), out=out)
                    assert bool((out.float() == 3.0).all()), f"byte {byte} bit {bit}: GPU wrote before failing"
                    raised += 1
                else:
                    assert bits_equal(codec.decode(cpu_frame.cuda(), out=out).cpu(), expected), f"byte {byte} bit {bit}"
                checked += 1
    assert raised > checked // 2


def test_decode_into_out_reads_no_header_on_the_host(monkeypatch):
    """decode(frame, out=...) and decode_blocks leave the header to the GPU for coded frames."""
    x = _random_bits(50_000, torch.bfloat16, seed=4, escape_rate=0.01).cuda()
    frame = codec.encode(x)
    cache = torch.randn(16, 2, 16, 256).to(torch.bfloat16).cuda()
    blocks = codec.encode_blocks(cache, [3, 7, 1])

    def no_host_parse(_frame):
        raise AssertionError("the host read the header")

    monkeypatch.setattr(codec.frames, "read_header", no_host_parse)
    out = torch.empty_like(x)
    assert bits_equal(codec.decode(frame, out=out), x)
    dst = torch.zeros_like(cache)
    codec.decode_blocks(blocks, dst, [0, 5, 9])
    assert bits_equal(dst[[0, 5, 9]].cpu(), cache[[3, 7, 1]].cpu())


def test_blocks_of_another_shape_are_refused():
    """A frame of the same element count but another block shape is an OutputMismatch (the GPU
    declines it, the host says why), and nothing is written."""
    cache = torch.randn(8, 2, 16, 256).to(torch.bfloat16).cuda()
    frame = codec.encode_blocks(cache, [1, 2])
    other = torch.zeros(8, 16, 2, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(codec.OutputMismatch):
        codec.decode_blocks(frame, other, [0, 1])
    assert int(torch.count_nonzero(other.view(torch.int16))) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stored_frames_decode_on_the_device(dtype):
    """Frames that coding did not pay for (random bits) are stored; the GPU copies them into
    ``out`` and into cache blocks itself, and they match the CPU bit for bit."""
    size = torch.empty(0, dtype=dtype).element_size()
    noise = torch.randint(0, 256, (64 * 512 * size,), dtype=torch.uint8).view(dtype).view(64, 512)
    frame = codec.encode(noise)
    assert codec.read_header(frame).codec == FrameCodec.STORED
    out = torch.empty(noise.shape, dtype=dtype, device="cuda")
    assert bits_equal(codec.decode(frame.cuda(), out=out).cpu(), noise)
    cache = noise.cuda()
    blocks = codec.encode_blocks(cache, [5, 60, 2], codec.calibrate(torch.randn(1000).to(dtype)))
    assert codec.read_header(blocks).codec == FrameCodec.STORED
    dst = torch.zeros_like(cache)
    codec.decode_blocks(blocks, dst, [1, 2, 3])
    assert bits_equal(dst[[1, 2, 3]].cpu(), noise[[5, 60, 2]])
    assert int(torch.count_nonzero(dst[4:].view(torch.uint8))) == 0


def _record_launches(monkeypatch) -> list[str]:
    names: list[str] = []
    launch = splitzip_gpu._Kernel.__call__

    def recorded(self, *args, **kwargs):
        names.append(self.name.split("<")[0])
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(splitzip_gpu._Kernel, "__call__", recorded)
    return names


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lean_and_general_kernels_agree(dtype, monkeypatch):
    """Aligned memory takes the lean kernels (the general ones only for a partial last chunk);
    memory that is not 16-byte aligned takes the general ones. Both give the CPU's frame and
    output bit for bit, escapes, a partial last chunk and a partial last group included."""
    n = 5 * 1024 + 13
    bits = codec.layout_for(dtype).int_dtype
    x = _random_bits(n, dtype, seed=11, escape_rate=0.03)
    book = codec.calibrate(torch.randn(5000).to(dtype))
    cpu = codec.encode(x, book)
    assert codec.read_header(cpu).codec == FrameCodec.SPLITZIP
    aligned = x.cuda()
    shifted = torch.zeros(n + 1, dtype=bits, device="cuda")
    shifted[1:].copy_(aligned.view(bits))
    unaligned = shifted[1:].view(dtype)
    launched = _record_launches(monkeypatch)
    assert torch.equal(codec.encode(aligned, book).cpu(), cpu)
    assert launched.count("encode_lean") == 1 and launched.count("encode_dense") == 1  # the last chunk
    launched.clear()
    assert torch.equal(codec.encode(unaligned, book).cpu(), cpu)
    assert "encode_lean" not in launched and "encode_dense" in launched
    launched.clear()
    out = torch.empty(n, dtype=dtype, device="cuda")
    assert bits_equal(codec.decode(cpu.cuda(), out=out).cpu(), x)
    assert "decode_lean" in launched and "decode_chunks" not in launched
    launched.clear()
    shifted.zero_()
    codec.decode(cpu.cuda(), out=unaligned)
    assert bits_equal(unaligned.cpu(), x) and int(shifted[0]) == 0
    assert "decode_chunks" in launched and "decode_lean" not in launched


def test_chunks_across_blocks_take_the_general_kernels(monkeypatch):
    """Blocks of 1536 elements hold no whole number of 1024-element chunks: encode_blocks runs
    the general kernel, and decode_blocks' device check declines the frame for the lean one
    (which then writes nothing), so the host path decodes it with the general kernel. Same bytes as the CPU either way."""
    gen = torch.Generator().manual_seed(8)
    cache = torch.randn(12, 1536, generator=gen).to(torch.bfloat16)
    ids, slots = [7, 0, 11, 3], [2, 9, 4, 10]
    book = codec.calibrate(cache)
    launched = _record_launches(monkeypatch)
    frame = codec.encode_blocks(cache.cuda(), ids, book)
    assert torch.equal(frame.cpu(), codec.encode(cache[ids], book))
    assert "encode_lean" not in launched
    launched.clear()
    dst = torch.zeros_like(cache).cuda()
    codec.decode_blocks(frame, dst, slots)
    assert bits_equal(dst[slots].cpu(), cache[ids])
    assert int(torch.count_nonzero(dst[[i for i in range(12) if i not in slots]].view(torch.int16))) == 0
    assert launched.count("decode_header") == 2 and launched[-1] == "decode_chunks"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunks_with_more_escapes_than_the_spill_holds(dtype):
    """Encode's scratch keeps an eighth of a chunk's elements as escapes; a chunk with more has
    them found again in the source by the tail. In a frame that stays coded: chunks with exactly
    that many escapes, one more, and all escapes, flat and as cache blocks."""
    chunk = 1024
    cap = chunk // splitzip_gpu.SPILL_FRACTION
    bits = codec.layout_for(dtype).int_dtype
    x = _random_bits(64 * chunk, dtype, seed=21, escape_rate=0.0)
    book = codec.calibrate(x)
    rare = _random_bits(1 << 16, dtype, seed=22, escape_rate=1.0).view(bits)
    outside = rare[~torch.isin(_exponents(rare.view(dtype)), torch.tensor(book.exponents))]
    flat = x.view(bits).clone()
    for c, count in ((5, chunk), (9, cap), (10, cap + 1), (63, 3 * cap)):
        where = torch.randperm(chunk, generator=torch.Generator().manual_seed(c))[:count] + c * chunk
        flat[where] = outside[c * 97:c * 97 + count]
    y = flat.view(dtype)
    cpu = codec.encode(y, book)
    header = codec.read_header(cpu)
    assert header.codec == FrameCodec.SPLITZIP and header.escapes >= chunk + 5 * cap + 1
    assert torch.equal(codec.encode(y.cuda(), book).cpu(), cpu)
    assert bits_equal(codec.decode(cpu.cuda()).cpu(), y)
    cache = y.view(64, chunk).cuda()
    ids = [63, 5, 0, 10, 9]
    assert torch.equal(codec.encode_blocks(cache, ids, book).cpu(), codec.encode(y.view(64, chunk)[ids], book))


def _exponents(x: torch.Tensor) -> torch.Tensor:
    layout = codec.layout_for(x.dtype)
    raw = x.view(layout.int_dtype).to(torch.int32) & ((1 << layout.total_bits) - 1)
    return (raw >> (layout.total_bits - 1 - layout.exp_bits)) & ((1 << layout.exp_bits) - 1)


def test_large_caches_zero_the_block_bitmap_with_a_memset():
    """A cache of 2**17 blocks needs a 16 KiB bitmap for spotting repeated ids: more than
    decode_header zeroes itself, so the host zeroes the scratch first. Repeated calls on fresh
    scratch find no stale bits; a repeated id is still caught, and nothing is written."""
    blocks = 1 << 17
    cache = torch.randn(blocks, 8).to(torch.bfloat16).cuda()
    ids = torch.randperm(blocks, device="cuda")[:4096]
    book = codec.calibrate(cache[:64])
    frame = codec.encode_blocks(cache, ids, book)
    for _ in range(3):
        dst = torch.zeros_like(cache)
        codec.decode_blocks(frame, dst, ids)
        assert torch.equal(dst[ids].view(torch.int16), cache[ids].view(torch.int16))
    repeated = ids.clone()
    repeated[-1] = repeated[0]
    dst = torch.zeros_like(cache)
    with pytest.raises(codec.OutputMismatch):
        codec.decode_blocks(frame, dst, repeated)
    assert int(torch.count_nonzero(dst.view(torch.int16))) == 0
