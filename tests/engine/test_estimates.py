"""The ``auto`` codec choice: Appendix-B model plus pipeline fill, and what it learns."""

from __future__ import annotations

import math

from kvferry.engine.engine import Estimates

MiB = 1 << 20


def test_no_codec_measurement_means_raw():
    choice, reason = Estimates().choose("p", 1 << 30, 64 * MiB)
    assert choice == "raw" and "inf" in reason


def test_a_fast_codec_wins_on_a_slow_link_by_about_the_ratio():
    est = Estimates(encode_gbps=300, decode_gbps=300, ratio=1.33, assumed_link_gbps=25)
    raw_s, coded_s = est.predict("p", 8 << 30, 64 * MiB)
    assert raw_s == (8 << 30) / 25e9
    assert 1.30 < raw_s / coded_s < 1.33  # the fill (one chunk encoded, one decoded) costs a little
    assert est.choose("p", 8 << 30, 64 * MiB)[0] == "splitzip"


def test_codec_bound_pipeline_loses_to_a_fast_link():
    est = Estimates(encode_gbps=100, decode_gbps=80, ratio=1.33, assumed_link_gbps=200)
    _, coded_s = est.predict("p", 8 << 30, 64 * MiB)
    assert math.isclose(coded_s, 128 * (64 * MiB / 80e9) + 64 * MiB / 100e9 + 64 * MiB / (1.33 * 200e9))
    assert est.choose("p", 8 << 30, 64 * MiB)[0] == "raw"


def test_small_transfers_pay_the_fill_so_a_slow_codec_sends_them_raw():
    est = Estimates(encode_gbps=0.5, decode_gbps=0.5, ratio=1.33, assumed_link_gbps=1.0)
    assert est.choose("p", 256 << 10, 4 * MiB)[0] == "raw"  # one chunk: encode + wire + decode in series
    assert est.choose("p", 1 << 30, 4 * MiB)[0] == "raw"  # codec-bound throughout
    fast = Estimates(encode_gbps=50, decode_gbps=50, ratio=1.33, assumed_link_gbps=1.0)
    assert fast.choose("p", 1 << 30, 4 * MiB)[0] == "splitzip"


def test_measured_link_and_ratio_replace_the_assumptions():
    est = Estimates(encode_gbps=300, decode_gbps=300, assumed_link_gbps=12.5)
    est.observe_link("p", 1 << 30, 1.0)
    assert math.isclose(est.link_gbps["p"], (1 << 30) / 1e9)
    assert "assumed" not in est.choose("p", 1 << 30, 64 * MiB)[1]
    assert "assumed" in est.choose("q", 1 << 30, 64 * MiB)[1]
    before = est.ratio
    est.observe_ratio(4 << 20, 3 << 20)
    assert est.ratio == 0.7 * before + 0.3 * (4 / 3)
    est.observe_ratio(4 << 10, 1 << 10)  # too small to tell
    assert est.ratio == 0.7 * before + 0.3 * (4 / 3)


def test_codec_speeds_follow_real_chunks():
    est = Estimates(encode_gbps=0.07, decode_gbps=0.3)
    for _ in range(20):
        est.observe_codec("encode", 8 * MiB, 8 * MiB / 0.6e9)
    assert math.isclose(est.encode_gbps, 0.6, rel_tol=1e-2) and est.decode_gbps == 0.3
    est.observe_codec("decode", 4 << 10, 1e-6)  # too small a chunk to time
    assert est.decode_gbps == 0.3


def test_measured_speeds_of_both_codecs_decide_once_fresh():
    est = Estimates(encode_gbps=900, decode_gbps=500, ratio=1.33, assumed_link_gbps=200)
    size = 4 << 30
    assert est.choose("p", size, 256 * MiB, now=0.0)[0] == "splitzip"  # the model, fast codec
    est.observe_transfer("p", "raw", size, size / 110e9, now=1.0)
    assert est.choose("p", size, 256 * MiB, now=2.0)[0] == "splitzip"  # one codec measured: still the model
    est.observe_transfer("p", "splitzip", size, size / 100e9, now=3.0)
    choice, reason = est.choose("p", size, 256 * MiB, now=4.0)
    assert choice == "raw" and "measured raw 110.00 vs splitzip 100.00" in reason
    assert est.choose("p", size + (size - 1), 256 * MiB, now=4.0)[0] == "raw"  # same power of two
    assert est.choose("p", 2 * size, 256 * MiB, now=4.0)[0] == "splitzip"  # another size: the model
    assert est.choose("q", size, 256 * MiB, now=4.0)[0] == "splitzip"  # another peer: the model
    assert est.choose("p", size, 256 * MiB, now=1.0 + est.measured_ttl_s + 1)[0] == "splitzip"  # stale


def test_measured_speeds_follow_repeats():
    est = Estimates()
    for seconds in (1.0, 0.5):
        est.observe_transfer("p", "raw", 1 << 30, seconds, now=0.0)
    assert math.isclose(est.measured[("p", "raw", 31)][0], 0.7 * (1 << 30) / 1e9 + 0.3 * (1 << 30) / 0.5e9)
    est.observe_transfer("p", "raw", 1 << 10, 1e-6, now=0.0)  # too small to tell
    assert ("p", "raw", 11) not in est.measured
