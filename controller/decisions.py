"""The decision audit trail and its counterfactual (shadow) scoring.

Every planned move becomes a :class:`Decision` with an outcome: ``planned`` (not yet acted on), ``shadow``
(recorded only: shadow mode, or no actuator can do it), ``applied``, ``failed`` or ``skipped`` (per-key
outcome of the actuator). The :class:`ShadowScorer` later asks the index whether the block came back:

* upward moves (promote / prefetch / admit / pin): came back within ``horizon_s`` -> the move would have
  produced a hit at the faster tier: ``score = +1`` (a counterfactual hit; ``tokens`` prefill tokens saved);
  not back -> ``score = 0`` (wasted move);
* downward moves (demote / evict): came back -> ``score = -1`` (the move would have cost a hit); else ``0``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.actuators.base import Outcome
from kvtier.controller.decision_ring import DecisionRing

OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)  # planned, shadow, applied, failed, skipped
UPWARD = frozenset({"promote", "prefetch", "admit", "pin"})

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Decision:
    id: int
    tick: int
    at_s: float  # loop clock seconds
    action: str
    block: int  # int64 block key
    src: str | None
    tier: str | None  # destination tier (evict: the tier dropped from)
    value_s: float  # planner value, expected seconds saved
    p_reuse: float
    pinned: bool
    layer: str  # actuator name, or "shadow"
    outcome: Outcome = Outcome.PLANNED
    detail: str = ""
    tokens: int = 0  # prefill tokens a hit on this block saves
    freq0: int = -1  # the block's access count in the index when decided (-1: untracked)
    came_back: bool | None = None  # accessed again within the horizon (None: not scored yet)
    score: float | None = None  # counterfactual hit gain (+1 / 0 / -1), None until scored
    scored_at_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["block_hash"] = f"{self.block & ((1 << 64) - 1):016x}"
        return d


@dataclass(slots=True)
class ShadowReport:
    """Counterfactual summary over scored decisions."""

    scored: int = 0
    upward: int = 0
    hits_gained: int = 0  # upward decisions whose block came back (would-be hits)
    tokens_gained: int = 0
    downward: int = 0
    regrets: int = 0  # downward decisions whose block came back
    unscored_dropped: int = 0  # oldest unscored decisions dropped to keep the pending queue bounded
    by_action: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def precision(self) -> float:
        return self.hits_gained / self.upward if self.upward else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["precision"] = self.precision
        return d


class DecisionLog:
    """Bounded, thread-safe ring of decisions, newest last.

    Decisions wait until their scoring horizon has passed. The ring keeps the newest ``max_len`` as
    columns (:class:`~kvtier.controller.decision_ring.DecisionRing`; what ``/v1/decisions`` shows, scores
    included; queries return snapshots); the pending (unscored) ones are kept as columns, ~41 B each
    (id, time, block, freq0, tokens, action), so a horizon's worth of decisions (e.g. 300 decisions/s over
    300 s) costs ~4 MB, not ~45 MB of objects. At most ``max_pending`` wait; beyond it the oldest unscored
    ones are dropped, counted in ``report.unscored_dropped`` and logged, never kept without bound.
    """

    _COLS: tuple[tuple[str, Any], ...] = (
        ("id", np.int64),
        ("at", np.float64),
        ("block", np.int64),
        ("freq0", np.int64),
        ("tokens", np.int64),
        ("act", np.int16),
        ("tier", np.int16),  # destination tier, for the shadow counters' tier label
    )

    def __init__(self, max_len: int = 20_000, max_pending: int = 100_000) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._ring = DecisionRing(max_len, Decision)
        self._lock = threading.Lock()
        self._next = 1
        self.max_pending = max_pending
        self._codes = self._ring.codes  # the pending "act" column uses the ring's string codes
        self._cap = 0
        self._lo = self._hi = 0  # pending rows are [lo, hi) of the columns, oldest first
        self._p: dict[str, npt.NDArray[Any]] = {c: np.zeros(0, t) for c, t in self._COLS}
        self.report = ShadowReport()

    def _append(self, ds: list[Decision]) -> None:
        self._ring.extend(ds)
        k = len(ds)
        if k == 0:
            return
        n = self._hi - self._lo
        if self._hi + k > self._cap:  # move the live rows to the front, grow if still short
            cap = max(self._cap, n + k, 1024)
            if n + k > cap // 2:
                cap = max(2 * cap, n + k)
            for c, t in self._COLS:
                arr: npt.NDArray[Any] = np.zeros(cap, t)
                arr[:n] = self._p[c][self._lo : self._hi]
                self._p[c] = arr
            self._cap, self._lo, self._hi = cap, 0, n
        lo, hi = self._hi, self._hi + k
        p = self._p
        p["id"][lo:hi] = [d.id for d in ds]
        p["at"][lo:hi] = [d.at_s for d in ds]
        p["block"][lo:hi] = [d.block for d in ds]
        p["freq0"][lo:hi] = [d.freq0 for d in ds]
        p["tokens"][lo:hi] = [d.tokens for d in ds]
        p["act"][lo:hi] = [self._codes.code(d.action) for d in ds]
        p["tier"][lo:hi] = [self._codes.code(d.tier) for d in ds]
        self._hi = hi
        self._bound_pending()

    def _bound_pending(self) -> None:
        over = self._hi - self._lo - self.max_pending
        if over <= 0:
            return
        self._lo += over
        first = self.report.unscored_dropped == 0
        self.report.unscored_dropped += over
        if first:
            log.warning(
                "decision log: more than %d decisions awaiting their scoring horizon; dropping the oldest "
                "unscored ones (counted in shadow.unscored_dropped)",
                self.max_pending,
            )

    def _materialize(self, rows: npt.NDArray[np.int64]) -> list[Decision]:
        """Pending rows as bare decisions with what scoring needs (id, time, block, action, freq0, tokens)
        and the destination tier its counters are labelled with;
        :meth:`mark_scored` writes their scores into the ring for those still shown there."""
        p, name = self._p, self._codes.name
        out: list[Decision] = []
        for i, at, b, f0, tok, a, t in zip(
            p["id"][rows].tolist(),
            p["at"][rows].tolist(),
            p["block"][rows].tolist(),
            p["freq0"][rows].tolist(),
            p["tokens"][rows].tolist(),
            p["act"][rows].tolist(),
            p["tier"][rows].tolist(),
            strict=True,
        ):
            act = name(a) or ""
            tier = name(t)
            out.append(Decision(i, -1, at, act, b, None, tier, 0.0, 0.0, False, "", tokens=tok, freq0=f0))
        return out

    def new_id(self) -> int:
        with self._lock:
            i = self._next
            self._next += 1
            return i

    def new_ids(self, k: int) -> range:
        """``k`` consecutive ids (one lock round for a tick's decisions)."""
        with self._lock:
            i = self._next
            self._next += k
            return range(i, i + k)

    def add(self, d: Decision) -> None:
        with self._lock:
            self._append([d])

    def add_many(self, ds: list[Decision]) -> None:
        """:meth:`add` of each, in order, under one lock."""
        with self._lock:
            self._append(ds)

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def total(self) -> int:
        """Decisions ever recorded (the ring keeps the newest ``max_len``)."""
        return self._next - 1

    def __iter__(self) -> Iterator[Decision]:
        with self._lock:
            return iter(self._ring)

    def query(
        self,
        limit: int = 100,
        action: str | None = None,
        tier: str | None = None,
        block: int | None = None,
        outcome: str | None = None,
    ) -> list[Decision]:
        """Newest first, filtered."""
        with self._lock:
            return self._ring.query(limit, action, tier, block, outcome)

    def pending(self) -> list[Decision]:
        with self._lock:
            return self._materialize(np.arange(self._lo, self._hi, dtype=np.int64))

    @property
    def n_pending(self) -> int:
        return self._hi - self._lo

    def due(self, before_s: float, limit: int) -> list[Decision]:
        """Oldest unscored decisions made before ``before_s`` (at most ``limit``; in order, stopping at the
        first later one)."""
        with self._lock:
            at = self._p["at"][self._lo : min(self._hi, self._lo + max(0, limit))]
            later = np.flatnonzero(at > before_s)
            k = int(later[0]) if later.size else at.shape[0]
            return self._materialize(np.arange(self._lo, self._lo + k, dtype=np.int64))

    def mark_scored(self, decisions: list[Decision]) -> None:
        """Drop ``decisions`` from the pending ones and add them to the report."""
        ids = np.fromiter((d.id for d in decisions), np.int64, len(decisions))
        with self._lock:
            self._ring.update_scores(decisions)  # what /v1/decisions shows
            k = ids.shape[0]
            live = self._p["id"][self._lo : self._hi]
            if k and k <= live.shape[0] and np.array_equal(live[:k], ids):
                self._lo += k  # the usual case: the oldest k, in order
            elif k:
                keep = ~np.isin(live, ids)
                m = int(keep.sum())
                for c in self._p:
                    col = self._p[c]
                    col[self._lo : self._lo + m] = col[self._lo : self._hi][keep]
                self._hi = self._lo + m
            for d in decisions:
                r = self.report
                r.scored += 1
                a = r.by_action.setdefault(d.action, {"scored": 0, "came_back": 0})
                a["scored"] += 1
                a["came_back"] += int(bool(d.came_back))
                if d.action in UPWARD:
                    r.upward += 1
                    if d.came_back:
                        r.hits_gained += 1
                        r.tokens_gained += d.tokens
                else:
                    r.downward += 1
                    r.regrets += int(bool(d.came_back))


def score(d: Decision, freq_now: int | None, now_s: float, horizon_s: float) -> bool:
    """Score ``d`` in place once its horizon has passed: it came back if its access count grew since."""
    if now_s < d.at_s + horizon_s:
        return False
    back = freq_now is not None and d.freq0 >= 0 and freq_now > d.freq0
    d.came_back = back
    d.score = (1.0 if back else 0.0) if d.action in UPWARD else (-1.0 if back else 0.0)
    d.scored_at_s = now_s
    return True
