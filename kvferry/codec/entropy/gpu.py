"""GPU path of the entropy codec: CuPy (NVRTC) kernels in ``entropy_cuda.cu``, one warp per
chunk, writing the reference's bytes. The host builds the header, the table streams and the
stream CRC (on a host copy of the frame: a GPU CRC is still to come), and handles the rare
stored chunks; everything per element runs on the device.

Decode writes only into fresh device memory and copies into the caller's tensor after the
device reported that every chunk decoded consistently.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .. import bitpack
from ..checksum import crc32c
from ..errors import CorruptFrame
from ..format import stored_size
from ..frames import encode_stored
from ..staging import optional_cupy
from .codebook import EntropyCodebook
from .format import (HEADER_SIZE, LANES, EntropyHeader, Stream, check_counts, chunk_caps, make_header,
                     num_chunks, pack_codebook, parse_tables, word_cap)
from .symbols import for_dtype

_SOURCE = Path(__file__).with_name("entropy_cuda.cu")
WARPS_PER_BLOCK = 4


def available() -> bool:
    """True when CUDA and CuPy are both usable."""
    return optional_cupy() is not None and torch.cuda.is_available()


@functools.cache
def _module(device_index: int):
    cupy = optional_cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++17",))
        module.compile()
    return module


def _kernel(name: str, device: torch.device):
    return _module(device.index or 0).get_function(name)


def _launch(kernel, nchunks: int, args: tuple, device: torch.device) -> None:
    cupy = optional_cupy()
    blocks = max(1, (nchunks + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
    with cupy.cuda.Device(device.index or 0), stream:
        kernel((blocks,), (32 * WARPS_PER_BLOCK,), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    """A device pointer as a kernel argument (passed by value, the width of a pointer)."""
    return np.uint64(t.data_ptr())


def _ptr_or_null(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0) if t is None else _ptr(t)


def _tables_on(book: EntropyCodebook, device: torch.device) -> dict[str, torch.Tensor]:
    key = ("gpu", str(device))
    if key not in book._cache:
        book._cache[key] = {
            "freq": torch.from_numpy(book.freqs.astype(np.uint16).view(np.int16)).to(device),
            "cum": torch.from_numpy(book.cumulative().astype(np.uint16).view(np.int16)).to(device),
            "slot": torch.from_numpy(book.slot_symbols().astype(np.uint16).view(np.int16)).to(device),
            "map": torch.from_numpy(book.context_map.astype(np.uint8)).to(device),
        }
    return book._cache[key]


PTAB_MAX = 1 << 27  # per-position table ids for periods up to 128 Mi elements (one byte each)


def _ptab(book: EntropyCodebook, device: torch.device) -> torch.Tensor | None:
    """Table of each position of one period, on the device (saves the kernels three 64-bit
    divisions an element), or None for longer periods."""
    period = book.geometry.period
    if period > PTAB_MAX:
        return None
    key = ("ptab", str(device))
    if key not in book._cache:
        g = book.geometry
        j = torch.arange(period, dtype=torch.int64, device=device)
        ctx = (j // (g.tokens * g.inner)) * g.inner + j % g.inner
        book._cache[key] = _tables_on(book, device)["map"][ctx]
    return book._cache[key]


def _geo_args(book: EntropyCodebook) -> tuple:
    g = book.geometry
    return (np.int64(g.period), np.int64(g.tokens * g.inner), np.int64(g.inner))


def encode(x: torch.Tensor, book: EntropyCodebook, *, checksum: bool, chunk: int) -> torch.Tensor:
    """The reference's frame of ``x``, computed on ``x``'s GPU."""
    sym = for_dtype(x.dtype)
    device = x.device
    flat = x.detach().contiguous().reshape(-1).view(torch.uint8)
    n = x.numel()
    nchunks = num_chunks(n, chunk)
    tabs = _tables_on(book, device)
    cap = word_cap(chunk, sym)
    slots = torch.empty(max(nchunks * cap, 1), dtype=torch.int16, device=device)
    counts = torch.empty(max(nchunks, 1), dtype=torch.int32, device=device)
    states = torch.empty(max(nchunks * LANES, 1), dtype=torch.int32, device=device)
    if nchunks:
        _launch(_kernel("entropy_encode", device), nchunks,
                (_ptr(flat), np.int32(sym.layout.itemsize), np.int32(sym.raw_bits), _ptr(tabs["freq"]),
                 _ptr(tabs["cum"]), _ptr(tabs["map"]), *_geo_args(book), np.int64(n), np.int32(chunk),
                 np.int32(nchunks), np.int32(book.prob_bits), np.int32(sym.sym_bits), np.int32(sym.alphabet),
                 np.int32(cap), _ptr(slots), _ptr(counts), _ptr(states), _ptr_or_null(_ptab(book, device))), device)
    counts_h = counts[:nchunks].cpu().numpy().view(np.uint32).astype(np.int64)  # the one sync
    caps = chunk_caps(n, chunk, sym)
    total_words = int(counts_h.sum())
    header = make_header(sym, tuple(x.shape), book, chunk, total_words)
    if header.total >= stored_size(sym.layout, n):
        return encode_stored(x, checksum=checksum)
    frame = torch.zeros(header.total, dtype=torch.uint8, device=device)
    o, ln = header.offsets, header.lengths
    host = pack_codebook(book) + b""
    frame[o[Stream.TABLES]:o[Stream.TABLES] + ln[Stream.TABLES]] = torch.frombuffer(bytearray(host), dtype=torch.uint8).to(device)
    frame[o[Stream.MAP]:o[Stream.MAP] + ln[Stream.MAP]] = tabs["map"]
    frame[o[Stream.COUNTS]:o[Stream.COUNTS] + ln[Stream.COUNTS]] = counts[:nchunks].view(torch.uint8)
    frame[o[Stream.STATES]:o[Stream.STATES] + ln[Stream.STATES]] = states[:nchunks * LANES].view(torch.uint8)
    if total_words:
        words = frame[o[Stream.WORDS]:o[Stream.WORDS] + ln[Stream.WORDS]].view(torch.int16)
        starts = torch.from_numpy(np.concatenate([[0], np.cumsum(counts_h)[:-1]]).astype(np.int64)).to(device)
        last = torch.tensor([int(caps[-1])], dtype=torch.int32, device=device)
        _launch(_kernel("entropy_gather", device), nchunks,
                (_ptr(slots), _ptr(counts), _ptr(starts), _ptr(last), np.int32(cap), np.int32(nchunks), _ptr(words)),
                device)
        for c in np.flatnonzero(counts_h == caps):  # stored chunks (rare): their symbols, packed
            e = min(chunk, n - c * chunk)
            bits = (flat.view(torch.int16) if sym.layout.itemsize == 2 else flat)[c * chunk:c * chunk + e]
            symbols = (bits.to(torch.int32) & ((1 << (8 * sym.layout.itemsize)) - 1)) >> sym.raw_bits
            packed = torch.zeros(2 * int(caps[c]), dtype=torch.uint8, device=device)
            p = bitpack.pack(symbols, sym.sym_bits)
            packed[:p.numel()] = p
            s0 = int(counts_h[:c].sum())
            words[s0:s0 + int(caps[c])] = packed.view(torch.int16)
    if sym.raw_bits and n:
        raw = frame[o[Stream.RAW]:o[Stream.RAW] + ln[Stream.RAW]]
        groups = (n + 7) // 8
        cupy = optional_cupy()
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with cupy.cuda.Device(device.index or 0), stream:
            _kernel("entropy_pack_raw", device)(((groups + 255) // 256,), (256,), (
                _ptr(flat), np.int32(sym.layout.itemsize), np.int32(sym.raw_bits), np.int64(n), _ptr(raw),
                np.int64(raw.numel())))
    if checksum:
        header = header.with_crc(crc32c(frame[HEADER_SIZE:].cpu().numpy().data))
    frame[:HEADER_SIZE] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8).to(device)
    return frame


def decode(frame: torch.Tensor, header: EntropyHeader) -> torch.Tensor:
    """Decode an entropy frame that lives on the GPU (header already parsed).

    Raises:
        CorruptFrame: any check fails; nothing of the caller's is written.
    """
    device = frame.device
    sym, n = header.sym, header.numel
    o, ln = header.offsets, header.lengths
    small_end = o[Stream.WORDS]
    head = frame[:small_end].cpu().numpy()  # tables, map, counts, states: small
    if header.stream_crc is not None and crc32c(frame[HEADER_SIZE:].cpu().numpy().data) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    book = parse_tables(header, head[o[Stream.TABLES]:o[Stream.TABLES] + ln[Stream.TABLES]].tobytes(),
                        head[o[Stream.MAP]:o[Stream.MAP] + ln[Stream.MAP]].tobytes())
    counts = head[o[Stream.COUNTS]:o[Stream.COUNTS] + ln[Stream.COUNTS]].view("<u4")
    starts = check_counts(header, counts)
    caps = chunk_caps(n, header.chunk, sym)
    stored = counts.astype(np.int64) == caps
    states = head[o[Stream.STATES]:o[Stream.STATES] + ln[Stream.STATES]].view("<u4")
    if (states.reshape(-1, LANES)[stored] != 0).any():
        raise CorruptFrame("a stored chunk has coder states")
    # Padding and the raw stream's unused bits, as the reference checks them (a few bytes).
    gaps, end = [], HEADER_SIZE
    for off, length in zip(o, ln):
        gaps += range(end, min(off, frame.numel()))  # an empty trailing stream has no padding
        end = max(end, off + length)
    raw_bits_total = sym.raw_bits * n
    last_raw = o[Stream.RAW] + ln[Stream.RAW] - 1
    probe = torch.tensor(gaps + ([last_raw] if raw_bits_total % 8 else []), dtype=torch.int64)
    probed = frame[probe.to(device)].cpu().numpy() if probe.numel() else np.zeros(0, dtype=np.uint8)
    if probed[:len(gaps)].any():
        raise CorruptFrame("padding between streams is not zero")
    if raw_bits_total % 8 and int(probed[-1]) >> (raw_bits_total % 8):
        raise CorruptFrame("unused bits of the raw stream are not zero")
    tabs = _tables_on(book, device)
    words = frame[o[Stream.WORDS]:o[Stream.WORDS] + ln[Stream.WORDS]]
    words16 = words.view(torch.int16) if words.numel() else torch.zeros(1, dtype=torch.int16, device=device)
    raw = frame[o[Stream.RAW]:o[Stream.RAW] + ln[Stream.RAW]]
    itemsize = sym.layout.itemsize
    out = torch.empty(max(n, 1) * itemsize, dtype=torch.uint8, device=device)
    err = torch.zeros(1, dtype=torch.int32, device=device)
    nchunks = header.nchunks
    if nchunks:
        starts_d = torch.from_numpy(starts).to(device)
        states_d = frame[o[Stream.STATES]:o[Stream.STATES] + ln[Stream.STATES]].view(torch.int32)
        stored_d = torch.from_numpy(stored.astype(np.uint8)).to(device)
        _launch(_kernel("entropy_decode", device), nchunks,
                (_ptr(words16), _ptr(starts_d), _ptr(states_d), _ptr(stored_d), _ptr(tabs["slot"]),
                 _ptr(tabs["freq"]), _ptr(tabs["cum"]), _ptr(tabs["map"]), *_geo_args(book), np.int64(n),
                 np.int32(header.chunk), np.int32(nchunks), np.int32(book.prob_bits), np.int32(sym.sym_bits),
                 np.int32(sym.alphabet), _ptr_or_null(_ptab(book, device)), _ptr(raw) if raw.numel() else np.uint64(0),
                 np.int64(raw.numel()), np.int32(sym.raw_bits), np.int32(itemsize), _ptr(out), _ptr(err)), device)
    elements = out[:n * itemsize].view(torch.int16 if itemsize == 2 else torch.uint8)
    for c in np.flatnonzero(stored):  # stored chunks (rare): symbols unpacked here
        lo = c * header.chunk
        e = min(header.chunk, n - lo)
        seg = words[2 * int(starts[c]):2 * int(starts[c + 1])]
        bits = bitpack.unpack(seg, e, sym.sym_bits) << sym.raw_bits
        if sym.raw_bits:
            bits |= bitpack.unpack(raw, n, sym.raw_bits)[lo:lo + e]
        elements[lo:lo + e] = bits.to(elements.dtype)
    if int(err.item()):
        raise CorruptFrame("coded streams do not decode to their end (corrupt words, states or escapes)")
    return elements.view(sym.layout.dtype).view(header.shape)
