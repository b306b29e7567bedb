"""The scikit-learn reuse predictor: a binned logistic model (a GAM) with table-lookup inference.

Training fits ``sklearn.linear_model.LogisticRegression`` on one-hot quantile bins of every feature
(so each feature gets a free-form monotone-or-not shape); inference is then a sum of per-bin weights,
a few microseconds per request, so the replay stays within a small factor of LRU. Quality metrics
(AUC, Brier, reliability bins) are plain numpy functions so they can be checked on hand-made cases.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import sparse
from sklearn.linear_model import LogisticRegression
from threadpoolctl import ThreadpoolController

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
_SPAN = 1e6  # feature values are clipped to [-_SPAN, _SPAN] before binning


@functools.cache
def blas_controller() -> ThreadpoolController:
    """One thread-pool controller per process: building one scans the loaded libraries (~5 ms), too much
    to repeat on every refit. Built at the first fit, once numpy/scipy's BLAS is loaded."""
    return ThreadpoolController()


class BinnedLogit:
    """Per-feature quantile bins -> one-hot -> L2 logistic regression; predicts reuse log-odds.

    Columns ``linear_cols`` of ``x`` also enter raw (unbinned), so the model extrapolates beyond the top
    bin (e.g. log frequency). Optional ``extra`` columns passed to :meth:`fit` (e.g. age) enter raw too;
    their coefficients are ``extra_coef`` and they are *not* part of :meth:`predict_logit`.
    """

    def __init__(
        self,
        *,
        n_bins: int = 12,
        c: float = 1.0,
        seed: int = 0,
        linear_cols: tuple[int, ...] = (),
        raw_only: tuple[int, ...] = (),
    ) -> None:
        self.linear_cols = list(linear_cols)
        self.raw_only = frozenset(raw_only)  # columns that get a single bin (they should be in linear_cols)
        self.lin_w: FloatArray = np.zeros(len(linear_cols))
        self.n_bins = n_bins
        self.rebin_every = 5  # recompute bin edges on every 5th fit; warm-start the others
        self._fits = 0
        self._lr: LogisticRegression | None = None
        self.c = c
        self.seed = seed
        self.edges: list[FloatArray] = []
        self.offsets: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.weights: FloatArray = np.zeros(0)
        self.intercept = 0.0
        self.extra_coef: FloatArray = np.zeros(0)
        self._shift: FloatArray = np.zeros(0)
        self._fidx: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._all_edges: FloatArray = np.zeros(0)
        self.trained = False
        self.n_train = 0

    def _bin(self, x: FloatArray) -> npt.NDArray[np.int64]:
        """Global one-hot column per (row, feature): one searchsorted over feature-shifted edges."""
        shifted = x.clip(-_SPAN, _SPAN) + self._shift  # (the method: a third of np.clip's call overhead)
        return self._all_edges.searchsorted(shifted.ravel(), side="right").reshape(x.shape) + self._fidx

    def fit(self, x: FloatArray, y: BoolArray, extra: FloatArray | None = None) -> None:
        """Fit on rows ``x`` (n, features) [+ raw ``extra`` (n, k)] with binary labels ``y``."""
        y = np.asarray(y, dtype=bool)
        if y.all() or not y.any():
            raise ValueError("need both positive and negative labels to train")
        if self._lr is None or self._fits % self.rebin_every == 0:
            self._set_edges(x)
            self._lr = LogisticRegression(
                C=self.c, max_iter=100, tol=1e-3, random_state=self.seed, warm_start=True
            )
        self._fits += 1
        idx = self._bin(x)
        n, nf = idx.shape
        nb = int(self.offsets[-1] + len(self.edges[-1]) + 1)
        onehot = sparse.csr_matrix(
            (np.ones(n * nf), idx.ravel(), np.arange(0, n * nf + 1, nf)), shape=(n, nb)
        )
        raw = [x[:, self.linear_cols]] if self.linear_cols else []
        if extra is not None:
            raw.append(extra)
        if raw:
            onehot = sparse.hstack([onehot, sparse.csr_matrix(np.hstack(raw))], format="csr")
        model = self._lr
        # one BLAS thread: the problem is tiny, and OpenBLAS threads spinning on a shared machine cost
        # more wall time than the whole fit (measured 2.5 s vs 0.4 s per replay of the conversation trace)
        with blas_controller().limit(limits=1, user_api="blas"):
            model.fit(onehot, y)
        coef = model.coef_[0].astype(np.float64)
        self.weights = coef[:nb]
        nl = len(self.linear_cols)
        self.lin_w = coef[nb : nb + nl]
        self.extra_coef = coef[nb + nl :]
        self.intercept = float(model.intercept_[0])
        self.trained = True
        self.n_train = n

    def _set_edges(self, x: FloatArray) -> None:
        qs = np.linspace(0.0, 1.0, self.n_bins + 1)[1:-1]
        self.edges = []
        for f in range(x.shape[1]):
            if f in self.raw_only:
                self.edges.append(np.zeros(0))
                continue
            u = np.unique(x[:, f])
            if u.size <= 2 * self.n_bins:  # few distinct values: one bin per value
                self.edges.append((u[:-1] + u[1:]) / 2.0)
            else:
                self.edges.append(np.unique(np.quantile(x[:, f], qs)))
        sizes = np.array([len(e) + 1 for e in self.edges], dtype=np.int64)
        nfeat = len(self.edges)
        self._shift = np.arange(nfeat, dtype=np.float64) * (4.0 * _SPAN)
        self._fidx = np.arange(nfeat, dtype=np.int64)
        self._all_edges = np.concatenate(
            [np.clip(e, -_SPAN, _SPAN) + self._shift[f] for f, e in enumerate(self.edges)]
        )
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def predict_logit(self, x: FloatArray) -> FloatArray:
        """Reuse log-odds per row (requires a fitted model)."""
        if not self.trained:
            raise RuntimeError("model not trained")
        if x.shape[0] == 0:
            return np.zeros(0)
        z = self.intercept + self.weights[self._bin(x)].sum(axis=1)
        if self.linear_cols:
            z += x[:, self.linear_cols] @ self.lin_w
        return z


def sigmoid(z: FloatArray) -> FloatArray:
    """Logistic function, numerically safe."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def sigmoid32(x: FloatArray) -> npt.NDArray[np.float32]:
    """``1 / (1 + exp(-x))`` in float32 (a new array): within float32 rounding of :func:`sigmoid`, tiny but
    nonzero down to x ~ -87 (then 0), ~4x cheaper than the float64 tanh form."""
    y = np.negative(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        np.exp(y, out=y)
    y += np.float32(1.0)
    np.reciprocal(y, out=y)
    return y


def auc(y: BoolArray, score: FloatArray) -> float | None:
    """Area under the ROC curve (ties count half); None when one class is missing."""
    y = np.asarray(y, dtype=bool)
    s = np.asarray(score, dtype=np.float64)
    n1 = int(y.sum())
    n0 = int(y.size - n1)
    if n1 == 0 or n0 == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average ranks over ties
    _, start, counts = np.unique(ss, return_index=True, return_counts=True)
    avg = start + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def brier(y: BoolArray, p: FloatArray) -> float | None:
    """Mean squared error of probabilities against 0/1 labels; None when empty."""
    if len(y) == 0:
        return None
    return float(np.mean((np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2))


def reliability(y: BoolArray, p: FloatArray, n_bins: int = 10) -> list[dict[str, Any]]:
    """Calibration table: per equal-width probability bin, count, mean prediction, observed rate."""
    p = np.asarray(p, dtype=np.float64)
    yy = np.asarray(y, dtype=np.float64)
    b = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    out: list[dict[str, Any]] = []
    for i in range(n_bins):
        m = b == i
        c = int(m.sum())
        if c:
            out.append(
                {
                    "lo": i / n_bins,
                    "hi": (i + 1) / n_bins,
                    "count": c,
                    "mean_pred": float(p[m].mean()),
                    "observed": float(yy[m].mean()),
                }
            )
    return out
