"""The benchmarks' wait for ``auto`` to settle on a codec (``demo.until_steady``)."""

from __future__ import annotations

from kvferry.demo import until_steady


def _runs(records: list[dict]):
    calls = []

    def run() -> dict:
        calls.append(records[len(calls)])
        return calls[-1]
    return run, calls


def test_a_repeated_first_choice_is_not_steady_before_the_tries():
    """A sidecar's first choices are unmeasured (a peer's first transfer, a codebook's first use):
    the same codec twice, then the tries, then the measured choice."""
    records = [{"chosen_codec": "entropy", "choice_reason": "predicted ..."},
               {"chosen_codec": "entropy", "choice_reason": "predicted ..."},
               {"chosen_codec": "raw", "choice_reason": "trying raw: ..."},
               {"chosen_codec": "tca-tbe", "choice_reason": "trying tca-tbe: ..."},
               {"chosen_codec": "entropy", "choice_reason": "measured ..."},
               {"chosen_codec": "entropy", "choice_reason": "measured ..."}]
    run, calls = _runs(records)
    until_steady(run)
    assert len(calls) == 5


def test_a_choice_with_nothing_to_try_is_steady_after_three():
    records = [{"chosen_codec": "raw", "choice_reason": "predicted ..."}] * 6
    run, calls = _runs(records)
    until_steady(run)
    assert len(calls) == 3


def test_a_choice_that_never_settles_stops_at_the_limit():
    records = [{"chosen_codec": c, "choice_reason": f"trying {c}"} for c in ["a", "b"] * 5]
    run, calls = _runs(records)
    until_steady(run, limit=6)
    assert len(calls) == 6
