"""`benchmarks/front_door_idle.py`: what each front door adds to an idle request's TTFT,
from per-round TTFTs (the live part needs the peer routers and is run by hand)."""

from __future__ import annotations

import pytest

from conftest import load_script

fdi = load_script("benchmarks/front_door_idle.py", "front_door_idle")


def test_added_over_direct_medians_and_per_round():
    ttfts = {"direct": [0.020, 0.030, 0.010], "astro": [0.025, 0.031, 0.012], "peer": [0.020, 0.030, 0.010]}
    rows = {r["arm"]: r for r in fdi.summary(ttfts)}
    a = rows["astro"]
    assert a["ttft_median_ms"] == pytest.approx(25.0)
    assert a["added_median_ms"] == pytest.approx(5.0)  # 25 − 20 ms (medians)
    assert a["added_paired_median_ms"] == pytest.approx(2.0)  # per round +5, +1, +2 ms → 2
    assert a["added_paired_p99_ms"] == pytest.approx(4.94)  # numpy's linear P99 of [1, 2, 5]
    assert rows["peer"]["added_paired_median_ms"] == 0 and rows["direct"]["added_median_ms"] == 0
    md = fdi.markdown(fdi.summary(ttfts))
    assert "| `astro` | 25.00 | 22.67 |" in md and "| +5.00 | +2.00 / +4.94 |" in md
