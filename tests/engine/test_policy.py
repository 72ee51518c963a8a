"""The ``auto`` codec choice: Appendix-B model plus pipeline fill, and what it learns."""

from __future__ import annotations

import math

from kvferry.engine.policy import EXPLORE_MARGIN, CodecSpeed, Policy

MiB = 1 << 20
COPY = 2000.0  # GB/s of a plain gather on a GPU, what the identity codec costs


def _policy(encode: float = 0.0, decode: float = 0.0, ratio: float = 1.33, link: float = 12.5) -> Policy:
    policy = Policy(codecs={"raw": CodecSpeed(COPY, COPY, 1.0), "coded": CodecSpeed(encode, decode, ratio)},
                    assumed_link_gbps=link)
    policy.warmed |= {"p", "q"}  # their first transfers seen
    return policy


def test_an_unmeasured_codec_is_never_chosen():
    choice, reason = _policy().choose("p", 1 << 30, 64 * MiB)
    assert choice == "raw" and "inf" in reason
    assert Policy(codecs={"a": CodecSpeed(), "b": CodecSpeed()}).choose("p", 1, 1)[0] == "a"  # first of equals


def test_a_fast_codec_wins_on_a_slow_link_by_about_the_ratio():
    policy = _policy(300, 300, 1.33, link=25)
    raw_s = policy.predict("p", 8 << 30, 64 * MiB, "raw")
    coded_s = policy.predict("p", 8 << 30, 64 * MiB, "coded")
    assert math.isclose(raw_s, (8 << 30) / 25e9, rel_tol=0.01)
    assert 1.30 < raw_s / coded_s < 1.34
    assert policy.choose("p", 8 << 30, 64 * MiB)[0] == "coded"


def test_codec_bound_pipeline_loses_to_a_fast_link():
    policy = _policy(100, 80, 1.33, link=200)
    coded_s = policy.predict("p", 8 << 30, 64 * MiB, "coded")
    assert math.isclose(coded_s, 128 * (64 * MiB / 80e9) + 64 * MiB / 100e9 + 64 * MiB / (1.33 * 200e9))
    assert policy.choose("p", 8 << 30, 64 * MiB)[0] == "raw"


def test_small_transfers_pay_the_fill_so_a_slow_codec_sends_them_raw():
    assert _policy(0.5, 0.5, link=1.0).choose("p", 256 << 10, 4 * MiB)[0] == "raw"
    assert _policy(0.5, 0.5, link=1.0).choose("p", 1 << 30, 4 * MiB)[0] == "raw"
    assert _policy(50, 50, link=1.0).choose("p", 1 << 30, 4 * MiB)[0] == "coded"


def test_candidates_restrict_the_choice():
    policy = _policy(300, 300, link=1.0)
    assert policy.choose("p", 1 << 30, 4 * MiB, candidates=["raw"])[0] == "raw"


def test_measured_link_and_ratio_replace_the_assumptions():
    policy = _policy(300, 300)
    policy.observe_link("p", 1 << 30, 1.0)
    assert math.isclose(policy.link_gbps["p"], (1 << 30) / 1e9)
    assert "assumed" not in policy.choose("p", 1 << 30, 64 * MiB)[1]
    assert "assumed" in policy.choose("q", 1 << 30, 64 * MiB)[1]
    before = policy.codecs["coded"].ratio
    policy.observe_ratio("coded", 4 << 20, 3 << 20)
    assert policy.codecs["coded"].ratio == 0.7 * before + 0.3 * (4 / 3)
    policy.observe_ratio("coded", 4 << 10, 1 << 10)  # too small to tell
    assert policy.codecs["coded"].ratio == 0.7 * before + 0.3 * (4 / 3)


def test_codec_speeds_follow_real_chunks():
    policy = _policy(0.07, 0.3)
    for _ in range(20):
        policy.observe_codec("coded", "encode", 8 * MiB, 8 * MiB / 0.6e9)
    assert math.isclose(policy.codecs["coded"].encode_gbps, 0.6, rel_tol=1e-2)
    assert policy.codecs["coded"].decode_gbps == 0.3
    policy.observe_codec("coded", "decode", 4 << 10, 1e-6)  # too small a chunk to time
    assert policy.codecs["coded"].decode_gbps == 0.3


def test_measured_speeds_of_every_candidate_decide_once_fresh():
    policy = _policy(900, 500, link=200)
    size = 4 << 30
    assert policy.choose("p", size, 256 * MiB, now=0.0)[0] == "coded"
    policy.observe_transfer("p", "raw", size, size / 110e9, now=1.0)
    assert policy.choose("p", size, 256 * MiB, now=2.0)[0] == "coded"  # one measured: still the model
    policy.observe_transfer("p", "coded", size, size / 100e9, now=3.0)
    choice, reason = policy.choose("p", size, 256 * MiB, now=4.0)
    assert choice == "raw" and "measured raw 110.00 vs coded 100.00" in reason
    assert policy.choose("p", size + (size - 1), 256 * MiB, now=4.0)[0] == "raw"  # same power of two
    assert policy.choose("p", 2 * size, 256 * MiB, now=4.0)[0] == "coded"  # another size: the model
    assert policy.choose("q", size, 256 * MiB, now=4.0)[0] == "coded"  # another peer: the model
    assert policy.choose("p", size, 256 * MiB, now=1.0 + policy.measured_ttl_s + 1)[0] == "coded"  # stale


def test_measured_speeds_are_the_median_of_recent_transfers():
    policy = _policy()
    size = 1 << 30
    for seconds in (1.0, 0.5):
        policy.observe_transfer("p", "raw", size, seconds, now=0.0)
    assert math.isclose(policy.measured[("p", "raw", 31)][0], (size / 1e9 + size / 0.5e9) / 2)
    for seconds in (0.5, 0.5, 0.5, 0.5):  # the first of five is gone
        policy.observe_transfer("p", "raw", size, seconds, now=1.0)
    assert math.isclose(policy.measured[("p", "raw", 31)][0], size / 0.5e9)
    policy.observe_transfer("p", "raw", size, 2.0, now=1.0 + policy.measured_ttl_s + 1)  # stale: starts again
    assert math.isclose(policy.measured[("p", "raw", 31)][0], size / 2e9)
    policy.observe_transfer("p", "raw", 1 << 10, 1e-6, now=0.0)
    assert ("p", "raw", 11) not in policy.measured


def test_one_slow_transfer_does_not_turn_auto_away_from_the_faster_codec():
    policy = _policy(450, 450, 1.53, link=50)
    policy.codecs["split"] = CodecSpeed(900, 1100, 1.33)
    size = 1 << 30
    for now in range(3):
        policy.observe_transfer("p", "coded", size, 0.0200, now=float(now))
        policy.observe_transfer("p", "split", size, 0.0215, now=float(now))
    policy.observe_transfer("p", "coded", size, 0.0700, now=3.0)  # a host's stall
    assert policy.choose("p", size, 256 * MiB, now=4.0)[0] == "coded"


def test_a_plan_is_tapered_only_where_a_chunk_spends_long_on_the_link_and_in_its_codec():
    slow = _policy(450, 450, 1.53, link=25)  # entropy's speeds: a 256 MiB chunk codes in 1.2 ms
    assert slow.tapers("p", 256 * MiB, "coded", on_gpu=True)  # ~7 ms of a 25 GB/s link per chunk
    assert not slow.tapers("p", 4 * MiB, "coded")  # a CPU chunk: ~0.1 ms on the link
    faster = _policy(450, 450, 1.53, link=50)  # ~3.5 ms a chunk, 0.44 ms an end piece
    assert not faster.tapers("p", 256 * MiB, "coded", on_gpu=True)  # less than a GPU call's fixed cost
    assert faster.tapers("p", 256 * MiB, "coded", on_gpu=False)  # a host call's is small
    slow.observe_link("p", 1 << 30, (1 << 30) / 200e9)  # this peer's link turned out fast
    assert not slow.tapers("p", 256 * MiB, "coded")
    assert slow.tapers("other", 256 * MiB, "coded")  # an unmeasured peer: the assumed link
    fast = _policy(900, 1100, 1.33, link=25)  # SplitZip's: 0.5 ms, less than two messages save
    assert not fast.tapers("p", 256 * MiB, "coded")
    assert not fast.tapers("p", 256 * MiB, "unmeasured")


def test_a_codec_the_model_puts_close_is_tried_once_then_the_measured_fastest_wins():
    policy = _policy(450, 450, 1.53, link=50)  # entropy-like: close to raw's time on a 50 GB/s link
    policy.codecs["split"] = CodecSpeed(900, 1100, 1.33)
    size = 1 << 30
    times = {c: policy.predict("p", size, 256 * MiB, c) for c in ("raw", "coded", "split")}
    assert times["coded"] < times["split"] < EXPLORE_MARGIN * times["coded"] < times["raw"]
    assert policy.choose("p", size, 256 * MiB, now=0.0)[0] == "coded"  # nothing measured: the model
    policy.observe_transfer("p", "coded", size, 0.0210, now=1.0)
    choice, reason = policy.choose("p", size, 256 * MiB, now=2.0)
    assert choice == "split" and reason.startswith("trying split") and "coded" in reason
    policy.observe_transfer("p", "split", size, 0.0194, now=3.0)
    choice, reason = policy.choose("p", size, 256 * MiB, now=4.0)
    assert choice == "split" and reason.startswith("measured coded 51.13 vs split 55.35 GB/s")  # raw: never tried
    later = 3.0 + policy.measured_ttl_s + 1  # split's measurement is stale, coded's too: the model again
    assert policy.choose("p", size, 256 * MiB, now=later)[0] == "coded"


def test_a_codec_far_behind_the_model_is_never_tried():
    policy = _policy(450, 450, 1.53, link=12.5)
    size = 1 << 30
    assert policy.predict("p", size, 256 * MiB, "raw") > EXPLORE_MARGIN * policy.predict("p", size, 256 * MiB, "coded")
    policy.observe_transfer("p", "coded", size, 0.06, now=0.0)
    choice, reason = policy.choose("p", size, 256 * MiB, now=1.0)
    assert choice == "coded" and reason.startswith("predicted")


def test_the_first_transfer_to_a_peer_is_not_measured():
    policy = Policy(codecs={"raw": CodecSpeed(COPY, COPY, 1.0), "coded": CodecSpeed(300, 300, 1.33)})
    policy.observe_transfer("p", "raw", 1 << 30, 1.0, now=0.0)  # opened the connection: a one-off cost
    assert not policy.measured
    policy.observe_transfer("p", "raw", 1 << 30, 0.1, now=0.0)
    assert math.isclose(policy.measured[("p", "raw", 31)][0], (1 << 30) / 0.1e9)
    policy.observe_transfer("p", "coded", 1 << 30, 0.1, now=0.0)  # another codec, same peer: a speed
    assert ("p", "coded", 31) in policy.measured
    policy.observe_transfer("q", "raw", 1 << 30, 0.1, now=0.0)  # another peer: its first
    assert ("q", "raw", 31) not in policy.measured


def test_transfers_in_flight_together_learn_the_links_total_and_share_it():
    """64 transfers on one 0.4 GB/s link each see 6 MB/s; a codec of 0.1 GB/s is faster than a
    share of the link but slower than the link: raw, as when one transfer runs alone. The link
    is learned as the shares' sum, and the codec's own speed is divided among the transfers."""
    policy = _policy(0.1, 0.1, 1.3, link=12.5)
    for _ in range(64):
        policy.begin_stream("p")
    for _ in range(10):
        policy.observe_link("p", 64 * MiB, 64 * MiB / (0.4e9 / 64), sharing=64)
    assert math.isclose(policy.link_gbps["p"], 0.4, rel_tol=0.01)
    choice, reason = policy.choose("p", 16 * MiB, 4 * MiB)
    assert choice == "raw" and "among 65 transfers" in reason
    alone = _policy(0.1, 0.1, 1.3, link=12.5)
    alone.observe_link("p", 64 * MiB, 64 * MiB / (0.4e9 / 64))  # one transfer that saw 6 MB/s
    assert alone.choose("p", 16 * MiB, 4 * MiB)[0] == "coded"  # what a share taken for the link picks
    faster = _policy(2.0, 2.0, 1.3, link=0.4)  # a codec faster than the whole link still wins
    for _ in range(8):
        faster.begin_stream("p")
    assert faster.choose("p", 1 << 30, 4 * MiB)[0] == "coded"


def test_streams_are_counted_per_peer_and_in_all():
    policy = _policy()
    assert policy.begin_stream("p") == (1, 1) and policy.begin_stream("q") == (1, 2)
    assert policy.begin_stream("p") == (2, 3) and policy.sharing("p") == (3, 4)
    assert policy.end_stream("p") == (2, 3) and policy.end_stream("p") == (1, 2)
    assert policy.end_stream("q") == (1, 1) and policy.streaming == {} and policy.sharing("p") == (1, 1)


def test_what_ran_beside_others_is_not_a_codecs_own_speed():
    policy = _policy(300, 300)
    policy.observe_codec("coded", "encode", 64 * MiB, 64 * MiB / 1e9, alone=False)
    assert policy.codecs["coded"].encode_gbps == 300
    policy.observe_transfer("p", "coded", 1 << 30, 1.0, now=0.0, alone=False)
    assert ("p", "coded", (1 << 30).bit_length()) not in policy.measured
    policy.observe_transfer("p", "coded", 1 << 30, 1.0, now=0.0)
    assert ("p", "coded", (1 << 30).bit_length()) in policy.measured


def test_a_codec_call_is_its_codecs_own_speed_only_if_it_ran_alone():
    import torch

    from kvferry.engine.pipeline import CodecRunner

    runner = CodecRunner(torch.device("cpu"), _policy(), lambda direction, seconds: None)
    first = runner._begin()
    assert runner._end(first)  # alone
    first = runner._begin()
    second = runner._begin()  # began beside the first
    assert not runner._end(second) and not runner._end(first)
    first = runner._begin()
    assert runner._end(runner._begin()) is False and runner._end(first) is False  # one began meanwhile
    assert runner._end(runner._begin())
