"""The learned policy's compact storage reads back exactly what the wide layout held."""

from __future__ import annotations

import numpy as np

from kvtier.policies import learned as learned_mod
from kvtier.policies.features import INT_FEATURES, N_FEATURES, FeatureRing
from kvtier.policies.learned import LearnedPolicy
from kvtier.replay.synthetic import multiturn_trace


def test_feature_ring_reads_back_float32_features_exactly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every stored feature row of a real run (ring wrapped around) reads back as float32(x) bit for bit,
    by row sets, slices, scalars and single columns; the int16 columns hold integers that fit."""
    seen: list[np.ndarray] = []
    real = learned_mod.request_features

    def spy(**kw):  # type: ignore[no-untyped-def]
        x = real(**kw)
        seen.append(x)
        return x

    monkeypatch.setattr(learned_mod, "request_features", spy)
    E = 4096
    pol = LearnedPolicy(200, event_buffer=E, retrain_every=200, horizon_s=30.0, min_class=50)
    for r in multiturn_trace(1200, seed=5, think_s=10.0, sessions_per_s=4.0):
        pol.access(r)
    x = np.concatenate(seen)
    assert x.shape[0] == pol._n_events > 2 * E
    ic = list(INT_FEATURES)
    assert np.array_equal(x[:, ic], np.round(x[:, ic])) and np.abs(x[:, ic]).max() <= 512
    last = x[-E:].astype(np.float32).astype(np.float64)  # what a float32 ring held
    pos = np.arange(pol._n_events - E, pol._n_events) % E
    ring = pol._ev_x
    assert isinstance(ring, FeatureRing) and ring.nbytes == E * (4 * (N_FEATURES - len(ic)) + 2 * len(ic))
    got = ring[pos]
    assert got.dtype == np.float64 and np.array_equal(got.view(np.int64), last.view(np.int64))
    assert np.array_equal(ring[int(pos[7])], last[7])
    assert np.array_equal(ring[0:5], last[np.argsort(pos)][0:5])
    for c in range(N_FEATURES):
        assert np.array_equal(ring[pos, c], last[:, c])
