"""The shared frame prefix (``kvferry.codec.prefix``): every codec's frames start with it, and
its checks name the first thing wrong."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from kvferry.codec import prefix
from tests.codec.test_registry import AXES, _blocks, _through


@pytest.mark.parametrize("name", codec.names())
def test_every_codec_writes_the_prefix_its_registry_entry_names(name, real_kv):
    c = codec.get(name)
    cache = _blocks(real_kv, 1)
    layout = codec.BlockLayout(tuple(cache.shape[1:]), AXES)
    extra, reference = {}, None
    if name == "predictive":  # a predictor's KV: k8v4's reconstruction of the same blocks
        k8v4 = codec.get("k8v4")
        reference = _through(k8v4, k8v4.bind(None, layout), cache)
        extra = {"predictor": reference}
    book = c.calibrate(cache, token_axis=4, axes=("block", *AXES), **extra)
    frame = c.encode_blocks(cache, torch.tensor([1, 0]), c.bind(book, layout, reference))
    head = frame[:prefix.SIZE].numpy().tobytes()
    assert head[:4] == prefix.MAGIC and codec.codec_of(frame) in (c, codec.get("raw"))
    assert head == prefix.pack(int.from_bytes(head[4:6], "little"), prefix.codec_id(head))


def test_parse_names_the_first_thing_wrong():
    good = prefix.pack(2, 5)
    assert prefix.parse(good, version=2, codec_ids=(5,), name="x") == 5
    assert prefix.parse(good, version=2) == 5  # a caller checking the id later
    with pytest.raises(codec.CorruptFrame, match="bad magic"):
        prefix.parse(b"KVFY" + good[4:], version=2, codec_ids=(5,), name="x")
    with pytest.raises(codec.CorruptFrame, match="codec id 5 is not the x codec's 4"):
        prefix.parse(good, version=3, codec_ids=(4,), name="x")  # the id before the version
    with pytest.raises(codec.CorruptFrame, match=r"codec id 5 is not a q codec's \(3, 4\)"):
        prefix.parse(good, version=2, codec_ids={4, 3}, name="q")
    with pytest.raises(codec.CorruptFrame, match=r"unsupported x format version 2 \(this build reads 3\)"):
        prefix.parse(good, version=3, codec_ids=(5,), name="x")
    with pytest.raises(codec.CorruptFrame, match=r"unsupported format version 2"):
        prefix.parse(good, version=3)


def test_body_writes_the_prefix_then_the_codec_fields():
    body = prefix.Body("BH")
    raw = body.write(1, 9, 7, 513)
    assert raw == b"KVFZ\x01\x00\x09\x07\x01\x02" and body.size == len(raw) == prefix.SIZE + 3
    assert body.read(raw, version=1, codec_ids=(9,), name="x") == (9, (7, 513))
    with pytest.raises(codec.CorruptFrame, match="codec id 9"):
        body.read(raw, version=1, codec_ids=(8,), name="x")


def test_check_frame_refuses_what_cannot_hold_a_codec_id():
    with pytest.raises(codec.CorruptFrame, match="1-D torch.uint8"):
        prefix.check_frame(torch.zeros(8, dtype=torch.int16))
    with pytest.raises(codec.CorruptFrame, match="6 bytes has no codec id"):
        prefix.check_frame(torch.zeros(6, dtype=torch.uint8))
    prefix.check_frame(torch.zeros(7, dtype=torch.uint8))
