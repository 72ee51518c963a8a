"""The numpy reference of tca-tbe: it defines the bytes the GPU kernels must write and read.

Encode: one exponent histogram picks the window, then every element is either in the window
(its 3-bit code goes into the tile's three bit-planes, its sign and mantissa into SIGNMAN) or
not (code 0, all 16 bits into FALLBACK). Decode checks every stream against the bitmaps before
it builds a single element, so a bad frame raises ``CorruptFrame`` and nothing else.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptFrame
from .format import GROUP_TILES, MAX_WINDOW_LOW, PLANES, TILE, WINDOW, Stream, TcaTbeHeader, num_tiles


def exponents(bits: np.ndarray) -> np.ndarray:
    """The 8-bit exponent field of each BF16 element (``bits`` as uint16)."""
    return (bits >> 7) & 0xFF


def choose_window(histogram: np.ndarray) -> int:
    """First exponent of the 7 numerically contiguous exponents that cover the most elements
    (the lowest such window on a tie): the paper's SelectTop7ConsecutiveExponents, per frame."""
    sums = np.concatenate([[0], np.cumsum(histogram.astype(np.int64))])
    covered = sums[WINDOW:] - sums[:-WINDOW]  # covered[lo] = elements with exponent in lo..lo+6
    assert covered.size == MAX_WINDOW_LOW + 1
    return int(np.argmax(covered))


def codes_of(bits: np.ndarray, window_low: int) -> np.ndarray:
    """3-bit code per element: 1..7 for exponents ``window_low``..``window_low + 6``, else 0."""
    rel = exponents(bits).astype(np.int32) - window_low
    return np.where((rel >= 0) & (rel < WINDOW), rel + 1, 0).astype(np.uint8)


def tile_offsets(in_window_per_tile: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start of each tile in SIGNMAN, the GROUPS stream as u64, the TILES stream as u16)."""
    starts = np.zeros(in_window_per_tile.size, dtype=np.int64)
    np.cumsum(in_window_per_tile[:-1], out=starts[1:])
    groups = starts[::GROUP_TILES]
    tiles = starts - np.repeat(groups, GROUP_TILES)[:starts.size]
    return starts, groups.astype("<u8"), tiles.astype("<u2")


def encode_streams(bits: np.ndarray) -> tuple[int, int, list[bytes]]:
    """``(window_low, in_window, streams)`` of the flat uint16 element bits."""
    n = bits.size
    window_low = choose_window(np.bincount(exponents(bits), minlength=256))
    codes = codes_of(bits, window_low)
    inside = codes != 0
    tiles = num_tiles(n)
    padded = np.zeros(tiles * TILE, dtype=np.uint8)
    padded[:n] = codes
    padded = padded.reshape(tiles, TILE)
    planes = np.stack([np.packbits((padded >> k) & 1, axis=1, bitorder="little").view("<u8")[:, 0]
                       for k in range(PLANES)], axis=1)  # [tiles, 3]
    _, groups, tile_rel = tile_offsets((padded != 0).sum(axis=1))
    signman = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)[inside]
    fallback = bits[~inside].astype("<u2")
    in_window = int(inside.sum())
    return window_low, in_window, [planes.astype("<u8").tobytes(), groups.tobytes(), tile_rel.tobytes(),
                                   signman.tobytes(), fallback.tobytes()]


def check_streams(header: TcaTbeHeader, streams: list[np.ndarray]) -> np.ndarray:
    """The codes of every element, after checking that the bitmaps, offsets and counts agree
    (what makes decode's reads stay inside SIGNMAN and FALLBACK).

    Raises:
        CorruptFrame: codes in a padding slot, or offsets or counts the bitmaps contradict.
    """
    n, tiles = header.numel, header.tiles
    planes = streams[Stream.BITMAPS].view("<u8").reshape(tiles, PLANES)
    bitplanes = np.unpackbits(planes.view(np.uint8).reshape(tiles, PLANES, 8), axis=2, bitorder="little")
    codes = (bitplanes[:, 0] | (bitplanes[:, 1] << 1) | (bitplanes[:, 2] << 2)).reshape(-1)
    if codes[n:].any():
        raise CorruptFrame("the last tile codes elements past the end of the tensor")
    _, groups, tile_rel = tile_offsets((codes.reshape(tiles, TILE) != 0).sum(axis=1))
    if not np.array_equal(streams[Stream.GROUPS].view("<u8"), groups):
        raise CorruptFrame("group offsets disagree with the bitmaps")
    if not np.array_equal(streams[Stream.TILES].view("<u2"), tile_rel):
        raise CorruptFrame("tile offsets disagree with the bitmaps")
    codes = codes[:n]
    if int(np.count_nonzero(codes)) != header.in_window:
        raise CorruptFrame(f"bitmaps code {np.count_nonzero(codes)} elements, header says {header.in_window}")
    return codes


def decode_streams(header: TcaTbeHeader, streams: list[np.ndarray]) -> np.ndarray:
    """The flat uint16 element bits of a frame whose header passed ``parse_header``.

    Raises:
        CorruptFrame: as ``check_streams``.
    """
    codes = check_streams(header, streams)
    inside = codes != 0
    out = np.empty(header.numel, dtype=np.uint16)
    sm = streams[Stream.SIGNMAN].astype(np.uint16)
    exponent = (codes[inside].astype(np.int32) + (header.window_low - 1)).astype(np.uint16)
    out[inside] = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    out[~inside] = streams[Stream.FALLBACK].view("<u2")
    return out


def decode_element(header: TcaTbeHeader, streams: list[np.ndarray], i: int) -> int:
    """Element ``i`` alone, as the GPU decodes it: constant time, from its tile's offsets.

    ``streams`` must have passed ``check_streams``; used by tests to pin down the addressing.
    """
    t, p = divmod(i, TILE)
    b = [int(w) for w in streams[Stream.BITMAPS].view("<u8")[PLANES * t:PLANES * t + PLANES]]
    start = int(streams[Stream.GROUPS].view("<u8")[t // GROUP_TILES]) + int(streams[Stream.TILES].view("<u2")[t])
    mask = b[0] | b[1] | b[2]
    below = bin(mask & ((1 << p) - 1)).count("1")
    code = sum(((b[k] >> p) & 1) << k for k in range(PLANES))
    if code:
        sm = int(streams[Stream.SIGNMAN][start + below])
        return ((sm & 0x80) << 8) | ((header.window_low + code - 1) << 7) | (sm & 0x7F)
    return int(streams[Stream.FALLBACK].view("<u2")[TILE * t - start + p - below])
