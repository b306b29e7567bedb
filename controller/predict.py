"""Reuse predictors the loop asks for P(reuse), one per tracked block slot.

:class:`HeuristicPredictor` is the always-available fallback (frequency x recency, vectorised); the learned
policy is adapted to the same :class:`ReusePredictor` protocol. Times are index milliseconds.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvtier.policies.index import BlockIndex

Probs = npt.NDArray[np.float32]
# freq clipped (then reused as float32 for tau), age, NaN mask
_Scratch = tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32], npt.NDArray[np.bool_]]
_FILL_CHUNK = 65_536  # rows per step of the NaN fill (bounds its float32 temporary)
_FREQ_TERM = (1.0 - np.exp(-np.arange(65, dtype=np.float32) / 2.0)).astype(np.float32)


@runtime_checkable
class ReusePredictor(Protocol):
    """``predict`` returns P(reuse) for slots ``[0, n)`` of ``index`` as of ``now_ms`` (causal: uses only
    what the index has observed). Optional class attribute ``returns_new_array = True``: every call returns
    a new float32 array the predictor keeps no reference to, so the loop may overwrite it in place."""

    name: str

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs: ...

    def info(self) -> dict[str, Any]: ...


class HeuristicPredictor:
    """``P = (1 - exp(-freq / 2)) * exp(-age / tau)``; ``tau`` = 4 x the reuse-gap EWMA (or ``tau_ms``)."""

    name = "heuristic"
    returns_new_array = True  # predict() returns a fresh array each call (the caller may overwrite it)

    def __init__(self, tau_ms: float = 300_000.0) -> None:
        self.tau_ms = tau_ms
        # scratch arrays reused across calls (fresh multi-MB temporaries per tick cost page faults); a
        # concurrent call (e.g. the API while a tick runs) allocates its own
        self._scratch_lock = threading.Lock()
        self._scratch: _Scratch | None = None

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs:
        if not self._scratch_lock.acquire(blocking=False):
            return self._predict(index, n, now_ms, None)
        try:
            sc = self._scratch
            if sc is None or sc[0].shape[0] != n:
                sc = self._scratch = (np.zeros(n, np.uint32), np.zeros(n, np.float32), np.zeros(n, np.bool_))
            return self._predict(index, n, now_ms, sc)
        finally:
            self._scratch_lock.release()

    def _predict(
        self,
        index: BlockIndex,
        n: int,
        now_ms: float,
        sc: _Scratch | None,
    ) -> Probs:
        freq = index.freq[:n]
        if sc is not None and freq.dtype == np.uint32:
            f = np.minimum(freq, len(_FREQ_TERM) - 1, out=sc[0])
        else:
            f = np.minimum(freq, len(_FREQ_TERM) - 1)
        p = _FREQ_TERM[f]  # 1 - exp(-freq / 2), from a table (float32)
        now = np.float64(now_ms)
        if sc is not None:
            age = np.subtract(now, index.last_access[:n], dtype=np.float32, out=sc[1])
            # the clipped freq is used up (p holds its table values): its buffer takes tau
            tau = np.multiply(index.gap_ewma[:n], np.float32(4.0), out=sc[0].view(np.float32))
        else:
            age = np.subtract(now, index.last_access[:n], dtype=np.float32)
            tau = index.gap_ewma[:n] * np.float32(4.0)
        np.maximum(age, 0.0, out=age)
        nan = np.isnan(tau, out=sc[2]) if sc is not None else np.isnan(tau)
        fill = np.float32(self.tau_ms)
        step = np.float32(fill - np.float32(4.0))
        if np.isfinite(fill) and np.float32(4.0) + step == fill:
            # branch-free (a masked store over a random mask costs ~5 ms at 1M rows): fmax turns NaN into
            # 4, then NaN rows get + (fill - 4) = fill exactly (checked above), the others + 0.0
            np.fmax(tau, np.float32(4.0), out=tau)
            buf = np.empty(min(n, _FILL_CHUNK), np.float32)
            for lo in range(0, n, _FILL_CHUNK):
                hi = min(n, lo + _FILL_CHUNK)
                b = np.multiply(nan[lo:hi], step, dtype=np.float32, out=buf[: hi - lo])
                tau[lo:hi] += b
        else:
            np.maximum(tau, np.float32(4.0), out=tau)
            np.putmask(tau, nan, fill)
        np.divide(age, tau, out=age)
        np.negative(age, out=age)
        np.exp(age, out=age)
        p *= age  # unused slots have freq 0, hence p = 0
        return p

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "version": "heuristic-1", "tau_ms": self.tau_ms, "trained": False}
