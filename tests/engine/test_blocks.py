"""Block lists: ids or ranges resolve to the same int64 ids, checked the same way."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine.blocks import Blocks, Ids, Range
from kvferry.engine.errors import InvalidBlocks


def _listed(ranges: list[Range]) -> list[int]:
    return [r.start + i * r.stride for r in ranges for i in range(r.count)]


@pytest.mark.parametrize("ranges", [
    [Range(i, 64, 300) for i in (7, 0, 299, 150)],  # alike: a block across a cache's layers and K/V
    [Range(5, 3, 2), Range(0, 0, 1), Range(100, 4, -7), Range(8, 1, 1)],  # mixed, empty, descending
    [Range(40, 1)],
])
def test_ranges_resolve_to_their_ids_in_order(ranges):
    assert Blocks(ranges=tuple(ranges)).resolve(300 * 64).tolist() == _listed(ranges)
    assert Blocks(ranges=tuple(ranges)).resolve(300 * 64).dtype == torch.int64


@pytest.mark.parametrize("ranges, match", [
    ([Range(0, 4, 100)], "in 0..299"),  # 300 past the end
    ([Range(3, 2, -5)], "in 0..99"),  # below zero
    ([Range(0, 3, 10), Range(20, 2, 1)], "repeat"),
    ([Range(0, 2, 0)], "stride other than 0"),
])
def test_bad_ranges_are_refused(ranges, match):
    with pytest.raises(InvalidBlocks, match=match):
        Blocks(ranges=tuple(ranges)).resolve(300 if match == "in 0..299" else 100)


def test_spread_ids_resolve_block_by_block():
    spread = Blocks(ids=(7, 0, 2), spread=(3, 10))
    assert len(spread) == 9 and spread.listed is None
    assert spread.resolve(30).tolist() == [7, 17, 27, 0, 10, 20, 2, 12, 22]
    assert Blocks(ids=(29,), spread=(2, -10)).resolve(30).tolist() == [29, 19]
    with pytest.raises(InvalidBlocks, match="in 0..29"):
        Blocks(ids=(1,), spread=(4, 10)).resolve(30)
    with pytest.raises(InvalidBlocks, match="repeat"):
        Blocks(ids=(0, 10), spread=(2, 10)).resolve(30)
    for bad in ((0, 1), (2, 0)):
        with pytest.raises(InvalidBlocks, match="spread"):
            Blocks(ids=(1,), spread=bad)
    with pytest.raises(InvalidBlocks, match="spread"):
        Blocks(ranges=(Range(0, 1),), spread=(2, 1))


def test_ids_stay_on_the_host_until_a_device_asks_and_two_sides_share_one_copy():
    meta = torch.device("meta")  # a device with no GPU: what `to` does, without the data
    src = Ids(Blocks(ids=(3, 1), spread=(2, 5)).resolve(20))
    dst = Ids(Blocks(ids=(0, 2, 4, 6)).resolve(8))
    assert src.on(torch.device("cpu")) is src.host and src.host.tolist() == [3, 8, 1, 6]
    a, b = src.with_(dst, meta)
    assert (a.device, b.device, a.shape, b.shape) == (meta, meta, (4,), (4,))
    assert a._base is not None and a._base is b._base  # slices of one copy
    assert src.on(meta) is a and dst.on(meta) is b  # made once
    again = src.with_(Ids(dst.host), meta)
    assert again[0] is a


def test_a_spread_within_one_stride_is_checked_on_its_ids_and_listed_only_when_asked():
    spread = Ids.of(Blocks(ids=(7, 0, 2), spread=(3, 10)), 30)
    assert spread.spread == ((7, 0, 2), 3, 10) and len(spread) == 9 and spread._host is None
    assert spread.host.tolist() == [7, 17, 27, 0, 10, 20, 2, 12, 22]
    assert Ids.of(Blocks(ids=(29, 21), spread=(2, -10)), 30).spread == ((29, 21), 2, -10)
    with pytest.raises(InvalidBlocks, match="0..29"):
        Ids.of(Blocks(ids=(1, 5), spread=(4, 10)), 30)
    with pytest.raises(InvalidBlocks, match="repeat"):
        Ids.of(Blocks(ids=(1, 5, 1), spread=(2, 10)), 30)
    wide = Ids.of(Blocks(ids=(0, 12), spread=(2, 10)), 30)  # ids a stride apart or more: listed and checked whole
    assert wide.spread is None and wide.host.tolist() == [0, 10, 12, 22]
    with pytest.raises(InvalidBlocks, match="repeat"):
        Ids.of(Blocks(ids=(0, 10), spread=(2, 10)), 30)


def test_a_short_list_is_checked_at_once_and_made_a_tensor_only_when_asked():
    ids = Ids.of(Blocks.of([3, 1]), 8)
    assert len(ids) == 2 and ids._host is None  # a one-block write by memcpy never asks
    assert ids.host.tolist() == [3, 1] and ids.host.dtype == torch.int64
    for bad, match in (([3, 8], "0..7"), ([1, 1], "repeat"), ([-1], "0..7")):
        with pytest.raises(InvalidBlocks, match=match):
            Ids.of(Blocks.of(bad), 8)
    assert Ids.of(Blocks.of(range(2, 6)), 8).host.tolist() == [2, 3, 4, 5]  # ranges: a tensor at once
    with pytest.raises(InvalidBlocks, match="no blocks"):
        Ids.of(Blocks.of([]), 8)
