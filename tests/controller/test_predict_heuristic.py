"""``HeuristicPredictor`` gives bit-for-bit the values of its formula (the reference below is the
straightforward masked-store version it replaced), with and without its scratch buffers."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.controller.predict import _FREQ_TERM, HeuristicPredictor
from kvtier.policies.index import BlockIndex


def _reference(index: BlockIndex, n: int, now_ms: float, tau_ms: float) -> np.ndarray:
    p = _FREQ_TERM[np.minimum(index.freq[:n], len(_FREQ_TERM) - 1)]
    age = np.maximum(np.subtract(np.float64(now_ms), index.last_access[:n], dtype=np.float32), 0.0)
    tau = np.maximum(index.gap_ewma[:n] * np.float32(4.0), np.float32(4.0))
    tau[np.isnan(tau)] = np.float32(tau_ms)
    return p * np.exp(-(age / tau))


@pytest.mark.parametrize("tau_ms", [300_000.0, 12_345.678, 0.3, 1e30, float("inf")])
def test_heuristic_matches_the_reference_formula_exactly(tau_ms: float) -> None:
    rng = np.random.default_rng(7)
    n = 150_001  # > 2 chunks of the NaN fill, the last one partial
    idx = BlockIndex(initial_capacity=n)
    idx.freq[:n] = rng.integers(0, 100, n).astype(np.uint32)
    idx.last_access[:n] = rng.uniform(0, 4e6, n)
    g = rng.uniform(0, 2e5, n).astype(np.float32)
    g[rng.random(n) < 0.4] = np.nan  # never re-touched
    g[:5] = [0.0, np.inf, -np.inf, 1e-3, 3.0]
    idx.gap_ewma[:n] = g
    pred = HeuristicPredictor(tau_ms=tau_ms)
    for now in (3.9e6, 4.2e6):
        want = _reference(idx, n, now, tau_ms)
        with_scratch = pred.predict(idx, n, now).copy()
        without = pred._predict(idx, n, now, None)
        assert with_scratch.dtype == np.float32
        assert np.array_equal(with_scratch.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(without.view(np.uint32), want.view(np.uint32))
