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
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Outcome = Literal["planned", "shadow", "applied", "failed", "skipped"]
OUTCOMES: tuple[Outcome, ...] = ("planned", "shadow", "applied", "failed", "skipped")
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
    outcome: Outcome = "planned"
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

    Decisions wait in a pending queue until their scoring horizon has passed. That queue holds at most
    ``max_pending`` (~300 B each: 100,000 is ~30 MB, 330 decisions/s over a 300 s horizon); beyond it the
    oldest unscored ones are dropped, counted in ``report.unscored_dropped`` and logged, never kept
    without bound.
    """

    def __init__(self, max_len: int = 20_000, max_pending: int = 100_000) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._d: deque[Decision] = deque(maxlen=max_len)
        self._lock = threading.Lock()
        self._next = 1
        self._pending: deque[Decision] = deque()  # not yet scored, oldest first
        self.max_pending = max_pending
        self.report = ShadowReport()

    def _bound_pending(self) -> None:
        over = len(self._pending) - self.max_pending
        if over <= 0:
            return
        for _ in range(over):
            self._pending.popleft()
        first = self.report.unscored_dropped == 0
        self.report.unscored_dropped += over
        if first:
            log.warning(
                "decision log: more than %d decisions awaiting their scoring horizon; dropping the oldest "
                "unscored ones (counted in shadow.unscored_dropped)",
                self.max_pending,
            )

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
            self._d.append(d)
            self._pending.append(d)
            self._bound_pending()

    def add_many(self, ds: list[Decision]) -> None:
        """:meth:`add` of each, in order, under one lock."""
        with self._lock:
            self._d.extend(ds)
            self._pending.extend(ds)
            self._bound_pending()

    def __len__(self) -> int:
        return len(self._d)

    @property
    def total(self) -> int:
        """Decisions ever recorded (the ring keeps the newest ``max_len``)."""
        return self._next - 1

    def __iter__(self) -> Iterator[Decision]:
        with self._lock:
            return iter(list(self._d))

    def query(
        self,
        limit: int = 100,
        action: str | None = None,
        tier: str | None = None,
        block: int | None = None,
        outcome: str | None = None,
    ) -> list[Decision]:
        """Newest first, filtered."""
        out: list[Decision] = []
        with self._lock:
            items = reversed(self._d)
            for d in items:
                if action is not None and d.action != action:
                    continue
                if tier is not None and d.tier != tier:
                    continue
                if block is not None and d.block != block:
                    continue
                if outcome is not None and d.outcome != outcome:
                    continue
                out.append(d)
                if len(out) >= limit:
                    break
        return out

    def pending(self) -> list[Decision]:
        with self._lock:
            return list(self._pending)

    def due(self, before_s: float, limit: int) -> list[Decision]:
        """Oldest unscored decisions made before ``before_s`` (at most ``limit``)."""
        out: list[Decision] = []
        with self._lock:
            for d in self._pending:
                if d.at_s > before_s or len(out) >= limit:
                    break
                out.append(d)
        return out

    def mark_scored(self, decisions: list[Decision]) -> None:
        done = {id(d) for d in decisions}
        with self._lock:
            while self._pending and id(self._pending[0]) in done:
                self._pending.popleft()
            if any(id(d) in done for d in self._pending):
                self._pending = deque(d for d in self._pending if id(d) not in done)
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
