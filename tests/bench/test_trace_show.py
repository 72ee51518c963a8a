"""``bench/trace/show.py`` lines two sidecars' steps up by the sender's submits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "trace"))

import show  # noqa: E402


def test_steps_of_both_sides_by_median_since_submit(tmp_path):
    sender, receiver = [], []
    for i in range(6):
        at = 1_000_000 * i
        sender += [("submit", at), ("leased", at + 2_000), ("post", at + 5_000 + 1_000 * (i % 2)),
                   ("enters DONE", at + 20_000)]
        receiver += [("header read", at + 9_000), ("post", at + 12_000), ("post", at + 13_000)]
    (tmp_path / "1.json").write_text(json.dumps(sender))
    (tmp_path / "2.json").write_text(json.dumps(receiver))
    rows = show.table(str(tmp_path), skip=1)  # transfers 1..4: the first is skipped, the last unbounded
    assert [(side, step, nth) for _, side, step, nth, _ in rows] == [
        ("S", "submit", 0), ("S", "leased", 0), ("S", "post", 0), ("R", "header read", 0), ("R", "post", 0),
        ("R", "post", 1), ("S", "enters DONE", 0)]
    assert {(side, step): median for median, side, step, nth, _ in rows if nth == 0}[("S", "post")] == 5.5
    assert all(n == 4 for *_, n in rows)
