"""Predictor calibration error as the status page and ``/metrics`` report it."""

from __future__ import annotations

import numpy as np

from kvtier.controller.tier_metrics import expected_calibration_error


def test_expected_calibration_error() -> None:
    bins = [
        {"count": 10, "mean_pred": 0.1, "observed": 0.2},
        {"count": 30, "mean_pred": 0.9, "observed": 0.8},
    ]
    assert np.isclose(expected_calibration_error(bins) or 0, 0.1)
    assert expected_calibration_error([]) is None
