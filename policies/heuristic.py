"""The one heuristic reuse predictor (frequency x recency), used wherever no fitted model answers.

:class:`HeuristicPredictor` is the reconcile loop's always-available fallback (per block-index row,
vectorised and incremental) and the learned policy's prior before its first fit and the key of its
heuristic experts (per access, from its features). Pure numpy; times are index milliseconds.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.policies.features import FEATURE_NAMES
from kvtier.policies.index import BlockIndex
from kvtier.policies.slotmap import grown_size

Probs = npt.NDArray[np.float32]
FloatArray = npt.NDArray[np.float64]
_CHUNK = 65_536  # rows per step when (re)building the cache (bounds its temporaries)
_FREQ_TERM = (1.0 - np.exp(-np.arange(65, dtype=np.float32) / 2.0)).astype(np.float32)
_PARTIAL_TAIL = FEATURE_NAMES.index("partial_tail")
_LOG_FREQ = FEATURE_NAMES.index("log_freq")


class _RowCache:
    """What the last call read per row (freq, clipped to 255, and the gap EWMA's bits) and the two factors
    it derived: the frequency term and ``-tau`` (ms). Rows whose inputs are unchanged keep their factors,
    so a call costs one age pass plus the rows touched since the last one. 13 bytes per row."""

    def __init__(self) -> None:
        self.index: object | None = None
        self.fill = np.float32(np.nan)
        self.n = 0
        self.touch_version: int | None = None  # the index's touch_version when the rows were read
        self.freq = np.zeros(0, np.uint8)  # min(freq, 255): the term saturates at 64, a reset shows
        self.gap = np.zeros(0, np.int32)  # float32 bits (NaN compares equal to itself)
        self.ft = np.zeros(0, np.float32)
        self.neg_tau = np.zeros(0, np.float32)

    def reserve(self, n: int) -> None:
        if self.freq.shape[0] >= n:
            return
        cap = grown_size(self.freq.shape[0], n)
        for name in ("freq", "gap", "ft", "neg_tau"):
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)


class HeuristicPredictor:
    """The heuristic reuse predictor: a frequency term times recency decay ``exp(-age / tau)``.

    One object, two read-outs of the same prior, for the two places that need P(reuse) before (or
    without) a fitted model:

    * :meth:`predict` -- per block-index row, for the reconcile loop's fallback (``tau_ms`` = the policy
      document's ``predictor.tau_s``, default 300 s):
      ``P = (1 - exp(-freq / 2)) * exp(-age / tau)``; ``tau`` = 4 x the row's reuse-gap EWMA, or
      ``tau_ms`` for a row never re-touched.
    * :meth:`log_odds` -- per access, from the learned policy's causal features, for its pre-fit scores
      and its heuristic-keyed experts (``tau_ms`` = 60 s there): the age-free log-odds
      ``-1 - 3 * partial_tail + 0.5 * min(log_freq, 3)`` (a partial tail block is rewritten by the next
      turn; re-touched blocks are likelier to return), decayed by ``age / tau_s`` in the policy's keys.

    Times: ``tau_ms`` in index milliseconds (:attr:`tau_s` the same in seconds).

    :meth:`predict` is incremental: the frequency term and ``tau`` are kept per row and recomputed only
    for rows whose ``freq`` or gap EWMA changed since the last call (and for new rows): the rows the
    index logged as touched or dropped (:meth:`BlockIndex.touched_since`), or, when its log does not
    reach back, those whose values differ from what was read. The same values, bit for bit, as the full
    formula (:meth:`predict_full`)."""

    name = "heuristic"
    returns_new_array = True  # predict() returns a fresh array each call (the caller may overwrite it)
    reads_index_only = True  # reads the index arrays and its own cache only: may run beside the policy

    def __init__(self, tau_ms: float = 300_000.0) -> None:
        self.tau_ms = tau_ms  # recency scale, ms: rows never re-touched (predict); every access (log_odds)
        # per-row state kept across calls; a concurrent call (e.g. the API while a tick runs) computes
        # everything afresh instead
        self._cache_lock = threading.Lock()
        self._cache = _RowCache()

    @property
    def tau_s(self) -> float:
        """The recency scale in seconds (``tau_ms / 1000``)."""
        return self.tau_ms / 1000.0

    @staticmethod
    def log_odds(feats: FloatArray) -> FloatArray:
        """Age-free reuse log-odds (unitless) of access feature rows (:data:`FEATURE_NAMES` columns
        first): a partial tail block is unlikely to return; blocks seen more than once are likelier to."""
        return -1.0 - 3.0 * feats[:, _PARTIAL_TAIL] + 0.5 * np.minimum(feats[:, _LOG_FREQ], 3.0)

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs:
        """P(reuse) of index rows ``[0, n)`` as of ``now_ms`` (a new float32 array)."""
        if not self._cache_lock.acquire(blocking=False):
            return self.predict_full(index, n, now_ms)
        try:
            if index.freq.dtype != np.uint32 or index.gap_ewma.dtype != np.float32:
                return self.predict_full(index, n, now_ms)
            return self._predict_cached(index, n, now_ms, self._cache)
        finally:
            self._cache_lock.release()

    def _predict_cached(self, index: BlockIndex, n: int, now_ms: float, c: _RowCache) -> Probs:
        fill = np.float32(self.tau_ms)
        freq, gap = index.freq[:n], index.gap_ewma[:n].view(np.int32)
        c.reserve(n)
        same = c.index is index and c.fill.tobytes() == fill.tobytes()
        m = min(c.n, n) if same else 0
        version = getattr(index, "touch_version", None)
        touched = None  # rows < m whose freq / gap may have changed (the index's log), else compare all
        if m and version is not None and c.touch_version is not None:
            log = index.touched_since(c.touch_version)
            if log is not None:
                touched = np.unique(np.asarray(log, np.intp))
                touched = touched[touched < m]
        c.index, c.fill, c.n, c.touch_version = index, fill, n, version
        out = np.empty(n, np.float32)  # the answer; its bytes serve as the change masks first
        if touched is not None:
            if touched.size:
                self._refresh(c, touched, freq[touched], gap[touched], fill)
        elif m:
            raw = out.view(np.uint8)  # 4n bytes: [0, m) freq clipped, [m, 2m) and [2m, 3m) the masks
            f8 = np.minimum(freq[:m], 255, out=raw[:m], casting="unsafe")
            d = np.not_equal(f8, c.freq[:m], out=raw[m : 2 * m].view(np.bool_))
            d |= np.not_equal(gap[:m], c.gap[:m], out=raw[2 * m : 3 * m].view(np.bool_))
            rows = np.flatnonzero(d)
            if rows.size:
                self._refresh(c, rows, freq[rows], gap[rows], fill)
        for lo in range(m, n, _CHUNK):  # new rows (all of them after a reset), in slices
            hi = min(n, lo + _CHUNK)
            self._refresh(c, slice(lo, hi), freq[lo:hi], gap[lo:hi], fill)
        age = np.subtract(np.float64(now_ms), index.last_access[:n], dtype=np.float32, out=out)
        if not getattr(index, "last_access_max", np.inf) <= now_ms:  # (else every age is >= 0 already)
            np.maximum(age, 0.0, out=age)
        np.divide(age, c.neg_tau[:n], out=age)  # age / -tau == -(age / tau), exactly
        np.exp(age, out=age)
        age *= c.ft[:n]  # unused slots have freq 0, hence p = 0
        return out

    @staticmethod
    def _refresh(
        c: _RowCache,
        rows: npt.NDArray[np.intp] | slice,
        freq: npt.NDArray[np.uint32],
        gap: npt.NDArray[np.int32],
        fill: np.float32,
    ) -> None:
        """Recompute the cached factors of ``rows`` from their freq / gap bits (read once by the caller:
        what is cached is what the factors came from)."""
        f8 = np.minimum(freq, 255).astype(np.uint8)
        c.freq[rows] = f8
        c.gap[rows] = gap
        c.ft[rows] = _FREQ_TERM[np.minimum(f8, len(_FREQ_TERM) - 1)]
        tau = gap.view(np.float32) * np.float32(4.0)
        # NaN (never re-touched) -> tau_ms; else at least 4 ms (as the full formula)
        tau = np.where(np.isnan(tau), fill, np.maximum(tau, np.float32(4.0)))
        c.neg_tau[rows] = np.negative(tau, out=tau)

    def predict_full(self, index: BlockIndex, n: int, now_ms: float) -> Probs:
        """P(reuse) of index rows ``[0, n)`` as of ``now_ms`` (ms) by the full formula over every row, without
        the per-row cache (a new float32 array): what :meth:`predict` answers when its cache is busy, and the
        reference its incremental path must equal bit for bit."""
        freq = index.freq[:n]
        p = _FREQ_TERM[np.minimum(freq, len(_FREQ_TERM) - 1)]  # 1 - exp(-freq / 2), from a table
        age = np.subtract(np.float64(now_ms), index.last_access[:n], dtype=np.float32)
        tau = index.gap_ewma[:n] * np.float32(4.0)
        np.maximum(age, 0.0, out=age)
        nan = np.isnan(tau)
        np.maximum(tau, np.float32(4.0), out=tau)
        np.putmask(tau, nan, np.float32(self.tau_ms))
        np.divide(age, tau, out=age)
        np.negative(age, out=age)
        np.exp(age, out=age)
        p *= age
        return p

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "version": "heuristic-1", "tau_ms": self.tau_ms, "trained": False}
