"""The learned policy's re-touch features (``extra_features``) and the predictor's raw-only columns."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.base import Request
from kvtier.policies.features import EXTRA_FEATURES, FEATURE_NAMES, N_FEATURES
from kvtier.policies.learned import LearnedPolicy
from kvtier.policies.predictor import BinnedLogit
from kvtier.replay.synthetic import multiturn_trace


def _req(t_s: float, ids: list[int]) -> Request:
    return Request(t_s * 1000.0, 16 * len(ids), 10, np.array(ids, dtype=np.int64), 16)


def _stored(pol: LearnedPolicy, n_rows: int) -> np.ndarray:
    """The last ``n_rows`` stored feature rows (as the ring reads them back), oldest first."""
    return pol.stored_features(n_rows)


def test_extra_features_are_appended_in_a_fixed_order_and_validated() -> None:
    assert LearnedPolicy(10, extra_features=()).feature_names == FEATURE_NAMES
    assert LearnedPolicy(10).feature_names == FEATURE_NAMES + ("log_life_s", "first_log_seen")  # default
    pol = LearnedPolicy(10, extra_features=("first_log_seen", "log_life_s"))
    assert pol.feature_names == FEATURE_NAMES + ("log_life_s", "first_log_seen")
    assert pol.stored_features(0).shape == (0, N_FEATURES + 2)
    with pytest.raises(ValueError, match="unknown extra features"):
        LearnedPolicy(10, extra_features=("time_of_day",))


def test_extra_features_hold_what_was_seen_before_the_request() -> None:
    """log_life_s: since the first access (-1 on first touch); log_gap2_s: since the second-to-last access
    (-1 below two accesses); first_log_seen: first touch x log1p(distinct blocks seen before / 1000)."""
    pol = LearnedPolicy(100, extra_features=EXTRA_FEATURES)
    life, gap2, seen = (pol.feature_names.index(f) for f in EXTRA_FEATURES)
    pol.access(_req(0.0, [1, 2]))  # both new; nothing seen before
    x = _stored(pol, 2)
    assert x[:, life].tolist() == [-1.0, -1.0] and x[:, gap2].tolist() == [-1.0, -1.0]
    assert x[:, seen].tolist() == [0.0, 0.0]
    pol.access(_req(10.0, [1, 2, 3]))  # 1, 2 second touch; 3 new with 2 blocks seen before
    x = _stored(pol, 3)
    np.testing.assert_allclose(x[:2, life], np.log1p(10.0), rtol=1e-6)
    assert x[:, gap2].tolist() == [-1.0, -1.0, -1.0]
    assert x[2, life] == -1.0
    np.testing.assert_allclose(x[:, seen], [0.0, 0.0, np.log1p(2 / 1000.0)], rtol=1e-6)
    pol.access(_req(25.0, [1, 2, 3, 4]))  # 1, 2 third touch: second-to-last access at 0 s
    x = _stored(pol, 4)
    np.testing.assert_allclose(x[:2, life], np.log1p(25.0), rtol=1e-6)
    np.testing.assert_allclose(x[:2, gap2], np.log1p(25.0), rtol=1e-6)
    assert x[2, gap2] == -1.0  # 3 was seen once
    np.testing.assert_allclose(x[2, life], np.log1p(15.0), rtol=1e-6)
    np.testing.assert_allclose(x[3, seen], np.log1p(3 / 1000.0), rtol=1e-6)
    pol.access(_req(40.0, [1]))  # second-to-last access of 1 was at 10 s
    np.testing.assert_allclose(_stored(pol, 1)[0, gap2], np.log1p(30.0), rtol=1e-6)


def _run(reqs: list[Request], **kw: object) -> tuple[list[bytes], list[list[int]]]:
    pol = LearnedPolicy(250, retrain_every=200, horizon_s=30.0, min_class=50, **kw)  # type: ignore[arg-type]
    hits, ev = [], []
    for r in reqs:
        hits.append(pol.access(r).tobytes())
        ev.append(pol.drain_evicted())
    assert pol.quality()["retrains"] >= 3
    return hits, ev


def test_with_extra_features_a_prefix_run_decides_like_the_full_run_and_is_deterministic() -> None:
    reqs = multiturn_trace(1500, seed=3, think_s=10.0, sessions_per_s=4.0)
    kw = {"extra_features": EXTRA_FEATURES, "seed": 3}
    full = _run(reqs, **kw)
    assert _run(reqs, **kw) == full
    hits, ev = _run(reqs[:1100], **kw)
    assert hits == full[0][:1100] and ev == full[1][:1100]


def test_a_raw_only_column_is_not_binned_and_extrapolates_linearly() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2))
    y = rng.random(4000) < 1.0 / (1.0 + np.exp(-(0.5 * x[:, 0] + 1.5 * x[:, 1])))
    m = BinnedLogit(linear_cols=(1,), raw_only=(1,))
    m.fit(x, y)
    assert len(m.edges[1]) == 0 and len(m.edges[0]) > 0  # one constant bin for the raw-only column
    base = np.array([[0.3, 0.0]])
    far = np.array([[0.3, 10.0]])  # far outside the training range
    slope = float(m.lin_w[0])  # the only linear column
    assert 1.0 < slope < 2.0
    np.testing.assert_allclose(m.predict_logit(far) - m.predict_logit(base), 10.0 * slope, rtol=1e-9)


def test_a_fit_runs_on_one_blas_thread_and_restores_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refit limits BLAS to one thread (spinning pool threads on a shared machine cost more than
    the fit) and puts the previous limits back afterwards; the controller is built once, not per fit."""
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_info

    import kvtier.policies.predictor as predictor

    real_fit = LogisticRegression.fit
    during: list[set[int]] = []

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        during.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return real_fit(self, *a, **k)

    monkeypatch.setattr(LogisticRegression, "fit", spy)
    before = {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3))
    y = x[:, 0] + rng.normal(size=500) > 0
    m = BinnedLogit()
    m.fit(x, y)
    ctrl = predictor.blas_controller()
    m.fit(x, y)
    assert during == [{1}, {1}]
    assert predictor.blas_controller() is ctrl
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == before
