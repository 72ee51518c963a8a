"""The ``predictive`` codec: bit-exact round trips of a real target/predictor pair (SmolLM2-135M
BF16 and its FP8-weight predictor), golden frames, corruption, the reference and sigma-table
checks, special values."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import codec
from kvferry.codec.layout import BlockLayout
from kvferry.codec.predictive import (NEEDS_REFERENCE, PredictiveCodebook, bind, calibrate_predictive, decode,
                                      decode_blocks, encode, encode_blocks, read_header)
from kvferry.codec.predictive import codec as predictive_codec
from kvferry.codec.predictive._phi import PHI
from kvferry.codec.predictive.format import HEADER_SIZE, lanes_for, min_lanes
from tests.conftest import bits_equal

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden"
AXES = ("layer", "kv", "head", "token", "channel")
BLOCK = 8  # tokens per block of the test regions


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    """(target, predictor) bf16 [3 layers, 2, 3 heads, 64 tokens, 64 channels]."""
    z = np.load(DATA / "predictive_pair.npz")
    return tuple(torch.from_numpy(z[k].view(np.int16)).view(torch.bfloat16) for k in ("target", "predictor"))


def blocks(x: torch.Tensor) -> torch.Tensor:
    """[layers, 2, heads, tokens, ch] -> [tokens / BLOCK, layers, 2, heads, BLOCK, ch] (a paged region)."""
    L, _, H, T, C = x.shape
    return x.reshape(L, 2, H, T // BLOCK, BLOCK, C).permute(3, 0, 1, 2, 4, 5).contiguous()


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def setup(request, pair):
    """Codebook calibrated on tokens 0..31; region = tokens 32..63 as 4 blocks, with its reference."""
    target, predictor = pair
    t = target.to(request.param)
    book = calibrate_predictive(t[..., :32, :], predictor[..., :32, :], AXES, predictor_name="test")
    region, reference = blocks(t[..., 32:, :]), blocks(predictor[..., 32:, :])
    layout = BlockLayout(tuple(region.shape[1:]), AXES)
    return book, layout, region, reference


def test_round_trip_real_pair(setup):
    book, layout, region, reference = setup
    bound = bind(book, layout, reference)
    frame = encode(region, bound)
    assert codec.codec_of(frame).name == "predictive"
    bits = 8 * frame.numel() / region.numel()
    assert bits < 0.6 * 8 * region.element_size()  # the predictor pays: well under raw
    assert bits_equal(decode(frame, bound), region)
    out = torch.empty_like(region)
    decode(frame, bound, out=out)
    assert bits_equal(out, region)
    c = codec.get("predictive")
    assert bits_equal(c.decode(c.encode(region, bound), bound), region)


def test_blocks_use_the_same_ids_of_each_sides_reference(setup):
    book, layout, region, reference = setup
    frame = encode_blocks(region, torch.tensor([3, 0]), bind(book, layout, reference))
    # the receiver's region has 6 blocks; its reference holds the same predictor KV at its ids
    cache = torch.zeros(6, *region.shape[1:], dtype=region.dtype)
    ref_rx = torch.zeros(6, *reference.shape[1:], dtype=reference.dtype)
    ref_rx[5], ref_rx[1] = reference[3], reference[0]
    decode_blocks(frame, cache, torch.tensor([5, 1]), bind(book, layout, ref_rx))
    assert bits_equal(cache[5], region[3]) and bits_equal(cache[1], region[0])
    assert not cache[0].view(torch.uint8).any()


def test_codebook_json_round_trip(setup):
    book, *_ = setup
    again = codec.get("predictive").codebook_from_json(book.to_json())
    assert again.digest == book.digest and np.array_equal(again.sigma, book.sigma)
    doc = json.loads(book.to_json())
    assert doc["format"] == "kvferry-predictive-codebook" and doc["version"] == 1
    doc["sigma_f32le"] = doc["sigma_f32le"][:-8] + "AAAAAAA="
    with pytest.raises(codec.CodebookMismatch):
        PredictiveCodebook.from_json(json.dumps(doc))
    with pytest.raises(codec.CodebookMismatch, match="not a"):
        PredictiveCodebook.from_json('{"format": "kvferry-entropy-codebook"}')


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_golden_frames(name):
    book = PredictiveCodebook.from_json((GOLDEN / f"predictive_{name}.codebook.json").read_text())
    dtype = getattr(torch, name)
    bits = torch.uint8 if name.startswith("float8") else torch.int16
    shape = (1, 1, 2, 3, 16, 64)
    x = torch.frombuffer(bytearray((GOLDEN / f"predictive_{name}.input.bin").read_bytes()), dtype=bits)
    x = x.view(dtype).view(shape)
    ref = torch.frombuffer(bytearray((GOLDEN / f"predictive_{name}.reference.bin").read_bytes()), dtype=torch.int16)
    ref = ref.view(torch.bfloat16).view(shape)
    golden = (GOLDEN / f"predictive_{name}.frame.bin").read_bytes()
    bound = bind(book, BlockLayout(shape[1:], AXES), ref)
    assert encode(x, bound).numpy().tobytes() == golden
    frame = torch.frombuffer(bytearray(golden), dtype=torch.uint8)
    assert bits_equal(decode(frame, bound), x)
    header = read_header(frame)
    assert header.shape == shape and header.digest == book.digest


def test_corruption_is_caught(setup):
    book, layout, region, reference = setup
    bound = bind(book, layout, reference)
    frame = encode(region, bound)
    for pos in (0, 6, 20, HEADER_SIZE - 1, HEADER_SIZE + 3, frame.numel() - 1):
        bad = frame.clone()
        bad[pos] ^= 0x10
        with pytest.raises(codec.CorruptFrame):
            decode(bad, bound)
    with pytest.raises(codec.CorruptFrame):
        decode(frame[:-4], bound)
    with pytest.raises(codec.CorruptFrame):
        decode(frame[:50], bound)
    with pytest.raises(codec.CorruptFrame):
        decode(torch.zeros(3, dtype=torch.uint8), bound)


def test_frames_in_fewer_lanes_than_the_encoder_gives_are_refused(setup, monkeypatch):
    """A decoder takes one sequential step per ``numel / lanes`` elements, so a frame coded in
    fewer lanes than the encoder ever gives its elements (about as many bytes) would cost it up
    to 64 times the encoder's own frame: it is corrupt, on every path that reads the header."""
    book, layout, region, reference = setup
    x, ref = region[:1], reference[:1]  # one block, 9216 elements: 36 lanes at least
    bound = bind(book, layout, ref)
    floor = min_lanes(x.numel())
    assert floor == 36
    monkeypatch.setattr(predictive_codec, "lanes_for", lambda numel, bits: floor - 1)
    frame = encode(x, bound)
    assert codec.codec_of(frame).name == "predictive"
    with pytest.raises(codec.CorruptFrame, match="lanes"):
        decode(frame, bound)
    with pytest.raises(codec.CorruptFrame, match="lanes"):
        decode_blocks(frame, torch.zeros_like(x), torch.tensor([0]), bound)
    monkeypatch.setattr(predictive_codec, "lanes_for", lambda numel, bits: floor)
    frame = encode(x, bound)
    assert read_header(frame).lanes == floor and bits_equal(decode(frame, bound), x)


@pytest.mark.parametrize("numel", [1, 2, 31, 255, 256, 257, 511, 4096, 9216, 16383, 16384, 16385, 1 << 20, 1 << 30])
def test_the_encoders_lanes_are_never_below_the_decoders_floor(numel):
    """Whatever the coded size (from nothing to 64 bits an element), the encoder's lanes are
    within what the decoder accepts, tiny tensors included."""
    for bits in (0.0, 1.0, 0.5 * numel, 2.0 * numel, 7.3 * numel, 16.0 * numel, 64.0 * numel, 2.0 ** 60):
        lanes = lanes_for(numel, bits)
        assert min_lanes(numel) <= lanes <= min(4096, numel)


def test_tampered_words_with_a_valid_checksum_are_caught(setup):
    """A frame whose stream CRC was recomputed after tampering still fails: every lane must end
    on the coder's initial state and every word must be consumed."""
    from kvferry.codec.checksum import crc32c

    book, layout, region, reference = setup
    bound = bind(book, layout, reference)
    frame = encode(region, bound).numpy().copy()
    header = read_header(torch.from_numpy(frame))
    frame[header.words_offset + 5] ^= 0x01
    body = frame[:HEADER_SIZE - 8].tobytes() + struct.pack("<I", crc32c(frame[HEADER_SIZE:].tobytes()))
    frame[:HEADER_SIZE] = np.frombuffer(body + struct.pack("<I", crc32c(body)), dtype=np.uint8)
    with pytest.raises(codec.CorruptFrame):
        decode(torch.from_numpy(frame), bound)


def test_reference_is_required_and_checked(setup):
    book, layout, region, reference = setup
    with pytest.raises(codec.CodebookMismatch, match="reference region holding the predictor's KV"):
        bind(book, layout, None)
    assert "reference region" in NEEDS_REFERENCE
    with pytest.raises(codec.CodebookMismatch, match="reference"):
        encode(region, book)  # the bare codebook: nothing to predict from
    with pytest.raises(codec.CodebookMismatch, match="reference"):
        encode(region, None)
    with pytest.raises(codec.CodebookMismatch, match="shape"):
        bind(book, layout, reference[:, :, :, :, :4])  # not [blocks, *layout]
    with pytest.raises(codec.CodebookMismatch, match="float16"):
        bind(book, layout, reference.to(torch.float16))  # calibrated on a bf16 predictor
    with pytest.raises(codec.CodebookMismatch):
        bind(book, BlockLayout(layout.shape, ("layer", "kv", "head", "token", "other")), reference)
    frame = encode(region, bind(book, layout, reference))
    with pytest.raises(codec.CodebookMismatch, match="reference"):
        decode(frame, bind(book, layout, reference[:2]))  # a reference of the wrong shape
    with pytest.raises(codec.CodebookMismatch, match="differ in shape"):
        encode(region[:2], bind(book, layout, reference))


def test_another_sigma_table_is_refused(setup, pair):
    book, layout, region, reference = setup
    target, predictor = pair
    frame = encode(region, bind(book, layout, reference))
    other = calibrate_predictive(target.to(region.dtype)[..., :16, :], predictor[..., :16, :], AXES)
    assert other.digest != book.digest
    with pytest.raises(codec.CodebookMismatch, match="sigma table"):
        decode(frame, bind(other, layout, reference))


def test_calibrate_needs_a_predictor(pair):
    target, _ = pair
    with pytest.raises(codec.CodebookMismatch, match="predictor"):
        codec.get("predictive").calibrate(target, token_axis=3)


def test_special_values_stay_lossless(setup):
    book, layout, region, reference = setup
    x = region.clone()
    flat = x.view(-1)
    special = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -3e38, 448.0]
    for i, v in enumerate(special):
        flat[i * 97] = torch.tensor(v).to(x.dtype) if x.dtype != torch.float8_e4m3fn or math.isfinite(v) \
            else torch.tensor(float("nan")).to(x.dtype)
    ref = reference.clone()
    ref.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38], dtype=ref.dtype)
    bound = bind(book, layout, ref)
    assert bits_equal(decode(encode(x, bound), bound), x)


def test_useless_reference_falls_back_to_a_stored_frame(setup):
    book, layout, region, reference = setup
    far = torch.full_like(reference, -1e4)
    bound = bind(book, layout, far)
    frame = encode(region, bound)
    assert codec.codec_of(frame).name == "raw"
    assert frame.numel() <= codec.get("predictive").capacity(region.shape, region.dtype)
    assert bits_equal(decode(frame, bound), region)


def test_registry_entry():
    c = codec.get("predictive")
    assert c.frame_id == 7 and c.lossless and not c.capabilities.standalone and c.capabilities.decode_needs_codebook
    assert c not in codec.lossless()  # auto never picks it


def test_phi_table_is_the_normal_cdf():
    """The frozen table is round(Phi(z) * 2**30) on z = -8 + j / 256 (a libm may differ by 1)."""
    for j in range(0, PHI.size, 64):
        z = -8 + j / 256
        assert abs(int(PHI[j]) - 0.5 * math.erfc(-z / math.sqrt(2)) * 2 ** 30) <= 1.0
    assert PHI[0] == 0 and PHI[-1] == 1 << 30 and (np.diff(PHI) >= 0).all()


def test_per_layer_region_names_its_layer(setup):
    book, layout, region, reference = setup
    axes = ("kv", "head", "token", "channel")
    x, ref = region[:, 1].contiguous(), reference[:, 1].contiguous()  # layer 1 of the table, alone
    per_layer = BlockLayout(tuple(x.shape[1:]), axes)
    with pytest.raises(codec.CodebookMismatch, match="layer"):
        bind(book, per_layer, ref)
    bound = bind(book, per_layer, ref, layer=1)
    assert np.array_equal(bound.sigma[0, 0, 0], book.sigma[1, 0, 0].astype(np.float64))
    assert bits_equal(decode(encode(x, bound), bound), x)
    with pytest.raises(codec.CodebookMismatch, match="outside"):
        bind(book, per_layer, ref, layer=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2], ids=["fp16", "e5m2"])
def test_other_dtypes_round_trip(dtype):
    g = torch.Generator().manual_seed(7)
    shape = (2, 2, 2, 16, 8)  # [layer, kv, head, token, channel]
    ref = torch.randn(shape, generator=g).to(torch.bfloat16)
    target = (ref.float() + 0.05 * torch.randn(shape, generator=g)).to(dtype)
    book = calibrate_predictive(target, ref, AXES)
    x, r = target.unsqueeze(0), ref.unsqueeze(0)
    bound = bind(book, BlockLayout(shape, AXES), r)
    frame = encode(x, bound)
    assert codec.codec_of(frame).name == "predictive"
    assert bits_equal(decode(frame, bound), x)
    with pytest.raises(codec.OutputMismatch):
        decode(frame, bound, out=torch.empty(3, dtype=dtype))
