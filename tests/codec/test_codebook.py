"""Calibration picks the most frequent exponents; codebooks serialize and reject bad input."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from tests.conftest import DTYPES


def test_top16_by_frequency_ties_by_value():
    # exponent e appears (e - 100) times for e in 101..120; top-16 are 120 down to 105
    values = [2.0 ** (e - 127) for e in range(101, 121) for _ in range(e - 100)]
    book = codec.calibrate([torch.tensor(values, dtype=torch.bfloat16)])
    assert book.exponents == tuple(range(120, 104, -1))
    assert book.samples == len(values)
    assert book.coverage == pytest.approx(sum(range(5, 21)) / len(values))


def test_fills_unseen_values_and_e4m3_is_top8():
    book = codec.calibrate([torch.ones(10, dtype=torch.float8_e4m3fn)])
    assert len(book.exponents) == 8 and book.exponents[0] == 7  # 1.0 has biased exponent 7
    assert book.exponents[1:] == (0, 1, 2, 3, 4, 5, 6)
    assert book.coverage == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_json_roundtrip(dtype):
    book = codec.calibrate([torch.randn(5000).to(dtype)])
    again = codec.Codebook.from_json(book.to_json())
    assert again == book


def test_kv_books_calibrate_separately(real_kv):
    k_book, v_book = codec.calibrate(real_kv["c0_k"]), codec.calibrate(real_kv["c0_v"])
    assert k_book.coverage > 0.999 and v_book.coverage > 0.999
    assert k_book != v_book


@pytest.mark.parametrize("text", [
    "not json", "{}", '{"format": "kvferry-codebook", "version": 2}',
    '{"format": "kvferry-codebook", "version": 1, "dtype": "bfloat16", "exponents": [1, 2]}',
    '{"format": "kvferry-codebook", "version": 1, "dtype": "float32", "exponents": [1]}',
    '{"format": "kvferry-codebook", "version": 1, "dtype": "float16", "exponents": ' + str(list(range(20, 36))) + "}",
    '{"format": "kvferry-codebook", "version": 1, "dtype": "bfloat16", "exponents": ' + str([1] * 16) + "}",
    "[]",
])
def test_bad_json_raises(text):
    with pytest.raises(codec.CodebookMismatch):
        codec.Codebook.from_json(text)


def test_calibrate_rejects_mixed_or_empty():
    with pytest.raises(codec.CodebookMismatch):
        codec.calibrate([])
    with pytest.raises(codec.CodebookMismatch):
        codec.calibrate([torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16)])
