"""Pure parts of ``bench.poll_cost``: switchback windows and their paired ratio."""

from __future__ import annotations

import math

import numpy as np

from bench.poll_cost import pair_ratio_ci, window_pairs


def test_windows_pair_each_polling_window_with_the_quiet_one_after_it() -> None:
    """Even windows poll, odd ones are quiet; failed requests and pairs missing a half are left out."""
    sent = [0.5, 1.0, 6.5, 7.0, 12.1, 13.0, 18.2, 24.5, 3.0]
    ttft = [0.11, 0.13, 0.10, 0.10, 0.12, 0.12, 0.10, 0.3, math.nan]
    assert window_pairs(sent, ttft, 6.0) == [(0.12, 0.10), (0.12, 0.10)]  # the window from 24 s has no pair


def test_pair_ratio_interval_covers_a_known_cost_and_excludes_one() -> None:
    """Quiet windows drift by 10 % between pairs; polling windows cost 3 % more: the paired interval holds
    1.03 and excludes 1 because each pair shares its minute."""
    rng = np.random.default_rng(3)
    host = 0.1 * (1 + rng.normal(0, 0.1, 20))
    pairs = [(h * 1.03 * (1 + rng.normal(0, 0.005)), h * (1 + rng.normal(0, 0.005))) for h in host]
    r, lo, hi = pair_ratio_ci(pairs)
    assert lo <= 1.03 <= hi and lo > 1.0 and abs(r - 1.03) < 0.01, (r, lo, hi)
    r, lo, hi = pair_ratio_ci(
        [(h * (1 + rng.normal(0, 0.005)), h * (1 + rng.normal(0, 0.005))) for h in host]
    )
    assert lo <= 1.0 <= hi, (r, lo, hi)
