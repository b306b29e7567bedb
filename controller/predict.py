"""The protocol of the reuse predictors the loop asks for P(reuse), one per tracked block slot.

The always-available fallback is :class:`kvtier.policies.heuristic.HeuristicPredictor`; the learned
model is adapted to the same :class:`ReusePredictor` protocol (``controller/model.py``). Times are index
milliseconds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvtier.policies.index import BlockIndex

Probs = npt.NDArray[np.float32]


@runtime_checkable
class ReusePredictor(Protocol):
    """``predict`` returns P(reuse) for slots ``[0, n)`` of ``index`` as of ``now_ms`` (causal: uses only
    what the index has observed). Optional class attribute ``returns_new_array = True``: every call returns
    a new float32 array the predictor keeps no reference to, so the loop may overwrite it in place.
    ``reads_index_only = True``: ``predict`` reads the index and its own state only, so the loop may run
    it on a worker thread beside the placement policy."""

    name: str

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> Probs: ...

    def info(self) -> dict[str, Any]: ...
