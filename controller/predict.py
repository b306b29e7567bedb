"""Reuse predictors the loop asks for P(reuse), one per tracked block slot.

:class:`HeuristicPredictor` is the always-available fallback (frequency x recency, vectorised); the learned
policy is adapted to the same :class:`ReusePredictor` protocol. Times are index milliseconds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvtier.policies.index import BlockIndex

Probs = npt.NDArray[np.float32]
_FREQ_TERM = (1.0 - np.exp(-np.arange(65, dtype=np.float32) / 2.0)).astype(np.float32)


@runtime_checkable
class ReusePredictor(Protocol):
    """``predict`` returns P(reuse) for slots ``[0, n)`` of ``index`` as of ``now_ms`` (causal: uses only
    what the index has observed)."""

    name: str

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs: ...

    def info(self) -> dict[str, Any]: ...


class HeuristicPredictor:
    """``P = (1 - exp(-freq / 2)) * exp(-age / tau)``; ``tau`` = 4 x the reuse-gap EWMA (or ``tau_ms``)."""

    name = "heuristic"

    def __init__(self, tau_ms: float = 300_000.0) -> None:
        self.tau_ms = tau_ms

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs:
        f = np.minimum(index.freq[:n], len(_FREQ_TERM) - 1)
        p = _FREQ_TERM[f]  # 1 - exp(-freq / 2), from a table (float32)
        age = np.subtract(np.float64(now_ms), index.last_access[:n], dtype=np.float32)
        np.maximum(age, 0.0, out=age)
        tau = index.gap_ewma[:n] * np.float32(4.0)
        np.maximum(tau, np.float32(4.0), out=tau)
        np.putmask(tau, np.isnan(tau), np.float32(self.tau_ms))  # (faster than boolean-index assignment)
        np.divide(age, tau, out=age)
        np.negative(age, out=age)
        np.exp(age, out=age)
        p *= age  # unused slots have freq 0, hence p = 0
        return p

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "version": "heuristic-1", "tau_ms": self.tau_ms, "trained": False}
