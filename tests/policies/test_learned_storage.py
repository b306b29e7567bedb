"""The learned policy's compact storage reads back exactly what the wide layout held."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.policies import learned as learned_mod
from kvtier.policies.features import EXTRA_FEATURES, INT_FEATURES, N_FEATURES, FeatureRing
from kvtier.policies.learned import LearnedPolicy
from kvtier.replay.synthetic import multiturn_trace


@pytest.mark.parametrize("extras", [(), EXTRA_FEATURES])
def test_feature_ring_reads_back_float32_features_exactly(monkeypatch, extras) -> None:  # type: ignore[no-untyped-def]
    """Every stored feature row of a real run (ring wrapped around) reads back as float32(x) bit for bit,
    by row sets, slices, scalars and single columns; the int16 columns hold integers that fit. With extra
    features the stored rows are the base rows with the extra columns appended (float32)."""
    seen: list[np.ndarray] = []
    if extras:
        real_extras = LearnedPolicy._with_extras

        def spy_extras(self, *a):  # type: ignore[no-untyped-def]
            x = real_extras(self, *a)
            seen.append(x)
            return x

        monkeypatch.setattr(LearnedPolicy, "_with_extras", spy_extras)
    else:
        real = learned_mod.request_features

        def spy(**kw):  # type: ignore[no-untyped-def]
            x = real(**kw)
            seen.append(x)
            return x

        monkeypatch.setattr(learned_mod, "request_features", spy)
    E = 4096
    pol = LearnedPolicy(
        200, event_buffer=E, retrain_every=200, horizon_s=30.0, min_class=50, extra_features=extras
    )
    for r in multiturn_trace(1200, seed=5, think_s=10.0, sessions_per_s=4.0):
        pol.access(r)
    x = np.concatenate(seen)
    n_cols = N_FEATURES + len(extras)
    assert x.shape == (pol._n_events, n_cols) and x.shape[0] > 2 * E
    ic = list(INT_FEATURES)
    assert np.array_equal(x[:, ic], np.round(x[:, ic])) and np.abs(x[:, ic]).max() <= 512
    last = x[-E:].astype(np.float32).astype(np.float64)  # what a float32 ring held
    pos = np.arange(pol._n_events - E, pol._n_events) % E
    ring = pol._ev_x
    assert isinstance(ring, FeatureRing) and ring.nbytes == E * (4 * (n_cols - len(ic)) + 2 * len(ic))
    got = ring[pos]
    assert got.dtype == np.float64 and np.array_equal(got.view(np.int64), last.view(np.int64))
    assert np.array_equal(ring[int(pos[7])], last[7])
    assert np.array_equal(ring[0:5], last[np.argsort(pos)][0:5])
    for c in range(n_cols):
        assert np.array_equal(ring[pos, c], last[:, c])


def _reference_reuse(pol: LearnedPolicy, slots: np.ndarray, now: float) -> np.ndarray:
    """The straightforward float64 formula: sigmoid(f(x) - max(0, now - last) / 1000 / (tau x mult)), the
    model run afresh on each slot's last access, NaN where the slot cannot be scored (the exp form of the
    sigmoid: exact for tiny P, where the tanh form rounds to 0)."""
    out = np.full(slots.shape[0], np.nan)
    ev = np.where(slots >= 0, pol._last_event[np.maximum(slots, 0)], -1)
    ok = (ev >= 0) & (ev > pol._n_events - pol._E)
    if ok.any():
        z = pol._logit_of_events(ev[ok])
        age_s = np.maximum(0.0, now - pol._last_ms[slots[ok]]) / 1000.0
        with np.errstate(over="ignore"):
            out[ok] = 1.0 / (1.0 + np.exp(-(z - age_s / (pol.tau_s * pol._real.mult))))
    return out


def _assert_p_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    # float32 rounding: of the log-odds x (relative error of P up to |x| x 2**-24) and of the result; P is
    # kept relative to its size down to tiny values (the float32 sigmoid does not round them to 0)
    g, w = got[ok].astype(np.float64), want[ok]
    x = np.log(w) - np.log1p(-w)
    assert (np.abs(g - w) <= (8 + np.abs(x)) * 2.0**-23 * w + 1e-38).all()


def test_reuse_probability_slots_equals_the_float64_reference() -> None:
    """All-scorable slot sets (the fast path), sets with unknown slots (-1) and with slots whose last
    access left the event ring (NaN), at a later and at a past time (some accesses after it), before and
    after the model is trained, and after the real cache's recency scale changed (the memoised static
    keys are rescaled, not recomputed)."""
    E = 4096
    pol = LearnedPolicy(300, event_buffer=E, retrain_every=200, horizon_s=30.0, min_class=50)
    rng = np.random.default_rng(3)
    checked_trained = rescaled = False
    for i, r in enumerate(multiturn_trace(1200, seed=3, think_s=10.0, sessions_per_s=4.0)):
        pol.access(r)
        if i % 60:
            continue
        n = pol._n_slots
        live = np.flatnonzero(pol._last_event[:n] > pol._n_events - E)
        sets = [rng.choice(live, size=min(500, live.size), replace=False), rng.integers(-1, n, 700)]
        for now in (float(r.timestamp_ms) + 5_000.0, float(r.timestamp_ms) - 20_000.0):
            for s in sets:
                s = s.astype(np.int64)
                _assert_p_close(pol.reuse_probability_slots(s, now), _reference_reuse(pol, s, now))
        assert np.isnan(pol.reuse_probability_slots(np.array([-1, -1]), now)).all()
        if i == 600:  # as an expert switch does: another recency scale for the real cache
            s = sets[0].astype(np.int64)
            pol.reuse_probability_slots(s, now)  # every key of ``s`` memoised at the current scale
            calls: list[int] = []
            model = pol._logit_of_events

            def counted(e: np.ndarray, calls: list[int] = calls, model: Any = model) -> np.ndarray:
                calls.append(e.size)
                return model(e)

            pol._logit_of_events = counted  # type: ignore[method-assign,assignment]
            pol._real.mult *= 8.0
            got = pol.reuse_probability_slots(s, now)
            del pol._logit_of_events
            assert calls == []  # the memoised keys were rescaled, the model not run again
            _assert_p_close(got, _reference_reuse(pol, s, now))
            pol._real.mult /= 8.0
            rescaled = True
        checked_trained |= pol.model.trained
    assert checked_trained and rescaled and pol._n_events > 2 * E
