"""The pieces of the entropy format v2 the round trips do not pin down on their own: the codes
(optimal, complete, at most CODE_BITS long), the exact refills of a chunk's last group, and the
raw and map packings with their padding checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvferry import codec
from kvferry.codec import entropy
from kvferry.codec.entropy import huffman
from kvferry.codec.entropy.format import (LANES, Stream, chunk_raw_words, map_bits, pack_map, pack_raw,
                                          raw_length, unpack_map, unpack_raw)
from kvferry.codec.entropy.reference import element_tables
from kvferry.codec.entropy.symbols import Geometry, element_bits
from tests.codec.test_entropy_roundtrip import kv_like, with_specials


def _cost(freqs: np.ndarray, lengths: np.ndarray) -> int:
    return int((freqs * lengths).sum())


def test_code_lengths_are_optimal_complete_and_limited():
    rng = np.random.default_rng(0)
    for trial in range(100):
        k = int(rng.integers(2, 7))
        freqs = np.zeros(12, dtype=np.int64)
        freqs[rng.choice(12, k, replace=False)] = rng.integers(1, 1000, k) ** int(rng.integers(1, 4))
        limit = int(rng.integers(max(3, int(np.ceil(np.log2(k)))), 6))
        lengths = huffman.code_lengths(freqs, limit)
        assert ((lengths > 0) == (freqs > 0)).all() and lengths.max() <= limit
        assert (2.0 ** -lengths[lengths > 0]).sum() == 1.0
        # No length-limited code does better (brute force over the symbols' lengths).
        used = np.flatnonzero(freqs)
        best = min(_cost(freqs[used], np.array(ls)) for ls in itertools.product(range(1, limit + 1), repeat=k)
                   if sum(2.0 ** -np.array(ls)) <= 1.0)
        assert _cost(freqs, lengths) == best, trial


def test_code_lengths_edge_cases():
    assert list(huffman.code_lengths(np.array([0, 5, 0]))) == [0, 1, 0]
    assert not huffman.code_lengths(np.zeros(4, dtype=np.int64)).any()
    skewed = np.array([1 << 40] + [1] * 512)  # 513 symbols: Huffman alone would go 512 bits deep
    lengths = huffman.code_lengths(skewed)
    assert lengths.max() == huffman.CODE_BITS and (2.0 ** -lengths).sum() == 1.0
    with pytest.raises(codec.CodebookMismatch):
        huffman.code_lengths(np.ones(2000, dtype=np.int64))


def test_canonical_codes_decode_through_the_lookup_table():
    book = entropy.calibrate(kv_like((4, 128, 32), torch.bfloat16, seed=3), token_axis=1, tables=4)
    ct = huffman.code_tables(book)
    lut = huffman.decode_lut(ct)
    for t in range(ct.tables):
        for s in np.flatnonzero(ct.lengths[t]):
            n, code = int(ct.lengths[t, s]), int(ct.codes[t, s])
            e = int(lut[t, code << (huffman.CODE_BITS - n)])
            assert e >> huffman.LEN_BITS == s and e & ((1 << huffman.LEN_BITS) - 1) == n
        assert (lut[t] != 0).all()  # complete: every bit pattern starts a code


def test_a_chunk_in_its_last_group_takes_no_spare_words():
    """In the last group of a chunk refills are exact, so a one-group chunk's lanes take just the
    words their bits fill (elsewhere a lane may take a word a segment's worst case would need)."""
    x = with_specials(kv_like((4, 256, 32), torch.bfloat16, seed=5), seed=6, rate=0.01)
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=7), token_axis=1, tables=4)
    ct = huffman.code_tables(book)
    chunk = 32 * LANES  # one group of steps
    frame = entropy.encode(x, book, checksum=False, chunk=chunk)
    h = entropy.read_header(frame)
    counts = frame[h.offsets[Stream.COUNTS]:][:h.lengths[Stream.COUNTS]].numpy().view("<u4")
    sym = ct.sym
    s = element_bits(x.contiguous()).astype(np.int64) >> sym.raw_bits
    t = element_tables(ct, 0, s.size)
    bits = np.where(ct.lengths[t, s] > 0, ct.lengths[t, s], ct.lengths[t, sym.esc] + sym.sym_bits)
    lane_bits = bits.reshape(-1, chunk // LANES, LANES).sum(axis=1)
    assert (counts == -(-lane_bits // 32).sum(axis=1)).all()


@pytest.mark.parametrize("numel, chunk, raw_bits", [(5000, 2048, 7), (1024, 1024, 10), (33, 32, 7),
                                                    (70000, 32768, 7), (96, 64, 10)])
def test_raw_fields_pack_per_lane_and_group(numel, chunk, raw_bits):
    rng = np.random.default_rng(numel)
    fields = rng.integers(0, 1 << raw_bits, numel)
    words = pack_raw(fields, chunk, raw_bits)
    assert words.nbytes == raw_length(numel, chunk, raw_bits)
    assert (unpack_raw(words, numel, chunk, raw_bits) == fields).all()
    # Lane 3's field of step 1 of the first group sits at bits R..2R of its first word.
    if numel > LANES + 3:
        assert (int(words[3]) >> raw_bits) & ((1 << raw_bits) - 1) == fields[LANES + 3]
    assert chunk_raw_words(chunk // LANES, raw_bits) * 4 * (numel // chunk) <= words.nbytes
    if numel % LANES or (numel // LANES) % 32:
        bad = words.copy()
        bad[-1] |= np.uint32(1 << 31)  # past the last lane's last field
        with pytest.raises(codec.CorruptFrame):
            unpack_raw(bad, numel, chunk, raw_bits)


def test_context_map_packs_to_as_few_bits_as_name_a_table():
    book = entropy.calibrate(kv_like((4, 64, 32), torch.bfloat16, seed=9), token_axis=1, tables=5)
    ct = huffman.code_tables(book)
    data = pack_map(ct)
    assert map_bits(ct.tables) == 3 and len(data) == -(-ct.geometry.contexts * 3 // 8)
    assert (unpack_map(data, ct.geometry.contexts, ct.tables) == ct.context_map).all()
    if ct.geometry.contexts * 3 % 8:
        bad = bytearray(data)
        bad[-1] |= 0x80
        with pytest.raises(codec.CorruptFrame):
            unpack_map(bytes(bad), ct.geometry.contexts, ct.tables)


def test_registry_frames_take_smaller_chunks_when_small():
    """The registry's frames keep at least WARPS_WANTED chunks down to MIN_REGISTRY_CHUNK: a
    chunk is one GPU warp's work."""
    from kvferry.codec.entropy.codec import MIN_REGISTRY_CHUNK, WARPS_WANTED, chunk_for

    assert chunk_for(1 << 30) == entropy.DEFAULT_CHUNK
    assert chunk_for(8 << 20) == 4096 == MIN_REGISTRY_CHUNK and chunk_for(100) == MIN_REGISTRY_CHUNK
    assert chunk_for(32 << 20) * WARPS_WANTED <= 32 << 20
    c = codec.get("entropy")
    x = kv_like((64, 16, 32), torch.bfloat16, seed=21)
    frame = c.encode_blocks(x, torch.arange(64), c.learn(x[:8]))
    assert entropy.read_header(frame).chunk == chunk_for(x.numel())
    out = torch.zeros_like(x)
    c.decode_blocks(frame, out, torch.arange(64))
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_table_words_per_context_match_the_words_per_position():
    """The fast coders' ``ptab4`` a word per context (FAST = 2) gives, at every position a lane
    visits (its lane index mod 128), the word the table per position has there."""
    from kvferry.codec.entropy import gpu

    g = Geometry(3, 16, 1024)
    cmap = torch.randint(0, 32, (g.contexts,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    j = torch.arange(g.period)
    ptab = cmap[(j // (g.tokens * g.inner)) * g.inner + j % g.inner].to(torch.uint8)
    compact, (hi, lo) = gpu._ptab4(g, ptab)
    assert (hi, lo) == (14, 10) and compact.numel() == g.contexts
    wide = ptab.to(torch.int32)
    per_position = sum(wide.roll(-32 * k) << (8 * k) for k in range(4))
    visited = j[j % 128 < 32]
    assert torch.equal(compact[((visited >> hi) << lo) | (visited & ((1 << lo) - 1))], per_position[visited])
    small = Geometry(1, 4, 128)  # short periods keep a word per position
    assert gpu._ptab4(small, torch.zeros(small.period, dtype=torch.uint8))[1] == (0, 0)
    odd = Geometry(2, 48, 640)  # rows not a power of two either
    assert gpu._ptab4(odd, torch.zeros(odd.period, dtype=torch.uint8))[1] == (0, 0)
