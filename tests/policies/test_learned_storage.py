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


def _reference_reuse(pol: LearnedPolicy, slots: np.ndarray, now: float) -> np.ndarray:
    """The straightforward (masked, out-of-place) version of ``reuse_probability_slots``."""
    from kvtier.policies.predictor import sigmoid

    out = np.full(slots.shape[0], np.nan)
    ev = np.where(slots >= 0, pol._last_event[np.maximum(slots, 0)], -1)
    ok = (ev >= 0) & (ev > pol._n_events - pol._E)
    if ok.any():
        z = pol._zcache.get(slots[ok], ev[ok], pol._score_version(), pol._logit_of_events)
        age_s = np.maximum(0.0, now - pol._last_ms[slots[ok]]) / 1000.0
        out[ok] = sigmoid(z - age_s / (pol.tau_s * pol._real.mult))
    return out


def test_reuse_probability_slots_equals_the_masked_reference_bit_for_bit() -> None:
    """All-scorable slot sets (the fast path), sets with unknown slots (-1) and with slots whose last
    access left the event ring (NaN), before and after the model is trained."""
    E = 4096
    pol = LearnedPolicy(300, event_buffer=E, retrain_every=200, horizon_s=30.0, min_class=50)
    rng = np.random.default_rng(3)
    checked_trained = False
    for i, r in enumerate(multiturn_trace(1200, seed=3, think_s=10.0, sessions_per_s=4.0)):
        pol.access(r)
        if i % 60:
            continue
        n = pol._n_slots
        live = np.flatnonzero(pol._last_event[:n] > pol._n_events - E)
        now = float(r.timestamp_ms) + 5_000.0
        sets = [rng.choice(live, size=min(500, live.size), replace=False), rng.integers(-1, n, 700)]
        for s in sets:
            s = s.astype(np.int64)
            got = pol.reuse_probability_slots(s, now)
            want = _reference_reuse(pol, s, now)
            assert np.array_equal(got, want, equal_nan=True)
            assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(pol.reuse_probability_slots(np.array([-1, -1]), now)).all()
        checked_trained |= pol.model.trained
    assert checked_trained and pol._n_events > 2 * E
