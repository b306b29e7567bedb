"""The live reuse model: trained on the block index, causally, persisted in the state store.

Causality: the manager takes a seeded sample *snapshot* of block features at ``T0`` (frequency, age, reuse
gap, depth, children, residency, all observed before ``T0``); at retrain time ``T1 >= T0 + horizon`` the
label of each sampled block is "its access count grew after ``T0``" (it came back). A logistic regression
(scikit-learn, seeded) is fit on 80 % and scored on the held-out 20 % (AUC, Brier, reliability bins).
Until a model exists the loop uses the heuristic predictor.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.predict import Probs
from kvtier.policies.index import BlockIndex
from kvtier.policies.predictor import auc as roc_auc
from kvtier.policies.predictor import brier as brier_score
from kvtier.policies.predictor import reliability

if TYPE_CHECKING:
    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.store import StateStore

log = logging.getLogger(__name__)

FEATURES = ("log_freq", "log_age_s", "log_gap_ewma_s", "has_gap", "depth", "log_children", "resident")


def index_features(
    index: BlockIndex, slots: npt.NDArray[np.int64] | slice, now_ms: float
) -> npt.NDArray[np.float32]:
    """Feature matrix (rows = ``slots``) from the index state as of ``now_ms``."""
    freq = index.freq[slots].astype(np.float32)
    age = np.maximum(0.0, now_ms - index.last_access[slots]).astype(np.float32) / 1000.0
    gap = index.gap_ewma[slots]
    has_gap = ~np.isnan(gap)
    gap_s = np.where(has_gap, gap, 0.0).astype(np.float32) / 1000.0
    x = np.empty((freq.shape[0], len(FEATURES)), np.float32)
    x[:, 0] = np.log1p(freq)
    x[:, 1] = np.log1p(age)
    x[:, 2] = np.log1p(gap_s)
    x[:, 3] = has_gap
    x[:, 4] = np.minimum(index.depth[slots], 512) / 64.0
    x[:, 5] = np.log1p(index.n_children[slots].astype(np.float32))
    x[:, 6] = index.tiers[slots] != 0
    return x


class LogisticReusePredictor:
    """P(reuse) = sigmoid(w . x + b) over :func:`index_features` (vectorised over all slots)."""

    name = "learned"

    def __init__(self, coef: npt.NDArray[np.float32], intercept: float, meta: dict[str, Any]) -> None:
        self.coef = coef.astype(np.float32)
        self.intercept = float(intercept)
        self.meta = meta

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs:
        x = index_features(index, slice(0, n), now_ms)
        z = x @ self.coef + np.float32(self.intercept)
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))
        p[~index.used[:n]] = 0.0
        return p.astype(np.float32)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, **self.meta}


@dataclass(slots=True)
class _Snapshot:
    at_ms: float
    slots: npt.NDArray[np.int64]
    hashes: npt.NDArray[np.int64]
    freq: npt.NDArray[np.uint32]
    x: npt.NDArray[np.float32]


class ModelManager:
    """Snapshots, retrains, persists and reloads the live predictor; reports its quality."""

    class NotTrainable(Exception):
        """Not enough labelled data yet (or a single class)."""

    def __init__(
        self, loop: ReconcileLoop, store: StateStore, *, sample: int = 50_000, min_samples: int = 50
    ) -> None:
        self.loop, self.store = loop, store
        self.sample = sample
        self.min_samples = min_samples
        self._snap: _Snapshot | None = None
        self._lock = threading.Lock()
        self.version = 0
        self._info: dict[str, Any] = {}

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng(self.loop.policy.predictor.seed + self.version)

    def snapshot(self) -> None:
        """Record features of a seeded sample of tracked blocks as of now (the T0 of the next labels)."""
        idx = self.loop.index
        now_ms = self.loop.clock() * self.loop.index_ms_per_s
        n = idx.n_rows
        slots = np.flatnonzero(idx.used[:n]).astype(np.int64)
        if slots.size > self.sample:
            slots = np.sort(self._rng().choice(slots, self.sample, replace=False))
        self._snap = _Snapshot(
            now_ms, slots, idx.hash[slots].copy(), idx.freq[slots].copy(), index_features(idx, slots, now_ms)
        )

    def maybe_snapshot(self) -> None:
        """Take the first snapshot, or a new one once the current one is at least a horizon old."""
        if self._snap is None:
            self.snapshot()

    def retrain(self) -> dict[str, Any]:
        """Refit the placement policy's own model (``learned``) and the fallback index model; persist the
        latter, swap it into the loop, start a new snapshot. NotTrainable when neither had enough labels."""
        with self._lock:
            pl = self.loop.placement
            policy_fit = pl.retrain() if pl is not None else False
            try:
                self._retrain_index_model()
            except self.NotTrainable:
                if not policy_fit:
                    raise
            return self.info()

    def _retrain_index_model(self) -> None:
        """Fit the fallback model (logistic regression over index features) on the snapshot's labels."""
        from sklearn.linear_model import LogisticRegression

        snap = self._snap
        if snap is None:
            self.snapshot()
            raise self.NotTrainable(
                "no feature snapshot yet: one was taken now; retrain after the reuse horizon has passed"
            )
        idx = self.loop.index
        still = idx.hash[snap.slots] == snap.hashes  # slot not reclaimed since
        y = (idx.freq[snap.slots] > snap.freq) & still
        x = snap.x[still]
        y = y[still]
        if y.size < self.min_samples or y.all() or not y.any():
            raise self.NotTrainable(
                f"need >= {self.min_samples} labelled blocks of both classes, have "
                f"{int(y.size)} ({int(y.sum())} came back)"
            )
        rng = np.random.default_rng(self.loop.policy.predictor.seed)
        perm = rng.permutation(y.size)
        cut = max(1, int(0.8 * y.size))
        tr, te = perm[:cut], perm[cut:]
        clf = LogisticRegression(max_iter=200, random_state=self.loop.policy.predictor.seed)
        clf.fit(x[tr], y[tr])
        pte = clf.predict_proba(x[te])[:, 1] if te.size else np.zeros(0)
        auc = roc_auc(y[te], pte) if te.size else None
        brier = brier_score(y[te], pte) if te.size else None
        rel = reliability(y[te], pte) if te.size else []
        info = {
            "kind": "logistic-index",
            "features": list(FEATURES),
            "trained": True,
            "training_samples": int(tr.size),
            "test_samples": int(te.size),
            "positive_rate": float(y.mean()),
            "auc": auc,
            "brier": brier,
            "calibration": rel,
            "snapshot_at_ms": snap.at_ms,
            "trained_at_s": self.loop.clock(),
            "seed": self.loop.policy.predictor.seed,
        }
        pred = LogisticReusePredictor(clf.coef_[0].astype(np.float32), float(clf.intercept_[0]), info)
        params = {
            "coef": [float(c) for c in pred.coef],
            "intercept": pred.intercept,
            "features": list(FEATURES),
        }
        self.version = self.store.save_model(info, params)
        info["version"] = self.version
        pred.meta = info
        self._install(pred, info)
        self.snapshot()

    def _install(self, pred: LogisticReusePredictor, info: dict[str, Any]) -> None:
        self._info = info
        if self.loop.policy.predictor.kind == "learned":
            self.loop.predictor = pred
        self._pred = pred
        m = self.loop.metrics
        if info.get("auc") is not None and self.policy_quality() is None:
            m.predictor_auc.set(float(info["auc"]))
        m.predictor_samples.set(float(info.get("training_samples", 0)))

    def load(self) -> bool:
        """Reload the latest persisted model (at startup). False when none is stored."""
        row = self.store.latest_model()
        if row is None:
            return False
        version, info, params = row
        try:
            coef = np.asarray(params["coef"], dtype=np.float32)
            intercept = float(params["intercept"])
            if coef.shape != (len(FEATURES),) or not np.isfinite(coef).all() or not np.isfinite(intercept):
                raise ValueError(f"expected {len(FEATURES)} finite coefficients, got shape {coef.shape}")
        except (KeyError, TypeError, ValueError) as exc:
            self.store.errors["row"] += 1
            log.error("state store: model %d unusable, starting without it: %s", version, exc)
            return False
        info["version"] = version
        self.version = version
        self._install(LogisticReusePredictor(coef, intercept, info), info)
        return True

    def policy_quality(self) -> dict[str, Any] | None:
        """The placement policy's own out-of-sample quality (``learned``, once fed requests), or None."""
        pl = self.loop.placement
        return pl.quality() if pl is not None and pl.served > 0 else None

    def info(self) -> dict[str, Any]:
        out = self._index_info()
        pl = self.loop.placement
        q = self.policy_quality()
        if pl is None:
            return out
        out["policy"] = pl.info()
        if q is None or pl.served == 0:  # no learned policy, or nothing feeds it: the index model is live
            return out
        # the policy's predictor is the live one; the index model is its fallback
        out["fallback_model"] = {k: out[k] for k in ("predictor", "version", "trained", "training_samples",
                                                     "auc", "brier", "calibration")}  # fmt: skip
        if q.get("auc") is not None:
            self.loop.metrics.predictor_auc.set(float(q["auc"]))
        out["auc_of"] = {
            "auc": f"the live model ({pl.name} placement policy): ROC AUC of P(reuse), held-out accesses",
            "fallback_auc": "the block-index model the policy falls back to, on the same accesses",
            "fallback_model.auc": "the block-index model on its own held-out window",
        }
        out.update(
            predictor=f"policy:{pl.name}",
            trained=bool(q.get("trained")),
            retrains=q.get("retrains", 0),
            training_samples=q.get("scored_accesses", 0),
            auc=q.get("auc"),
            auc_first_touch=q.get("auc_first_touch"),
            auc_retouched=q.get("auc_retouched"),
            fallback_auc=q.get("fallback_auc"),
            brier=q.get("brier"),
            calibration=q.get("reliability", []),
            beat_fallback_rate=q.get("beat_fallback_rate"),
            quality=q,
        )
        return out

    def _index_info(self) -> dict[str, Any]:
        live = self.loop.predictor
        out: dict[str, Any] = {
            "predictor": live.name,
            "version": self.version,
            "trained": bool(self._info),
            "training_samples": self._info.get("training_samples", 0),
            "auc": self._info.get("auc"),
            "brier": self._info.get("brier"),
            "calibration": self._info.get("calibration", []),
            "settings": self.loop.policy.predictor.model_dump(),
            "snapshot_at_ms": self._snap.at_ms if self._snap else None,
            "snapshot_blocks": int(self._snap.slots.size) if self._snap else 0,
        }
        if self._info:
            out["model"] = {k: v for k, v in self._info.items() if k != "calibration"}
        out["auc_of"] = {"auc": "the block-index reuse model: ROC AUC of P(reuse) on its held-out window"}
        return out
