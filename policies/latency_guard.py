"""Latency guard: a switchback experiment on the engine's own time to first token (TTFT).

Why: the L1 guard (:mod:`kvtier.policies.l1_admission`) judges the keeper by L1 hits, and hits are a means.
Where loading a chunk costs more than recomputing it (a small model on CPU: docs/perf/live_ab_lmcache_l1.md)
active mode raised vLLM's hit tokens by half and its mean TTFT by a third, and the L1 guard saw nothing
wrong. This guard measures the cost the operator cares about, on the live engine, with the sidecar's own
acting as the treatment.

How: time is cut into periods (the caller's measurement period, seconds). The guard runs blocks of
``act_periods`` periods in its current state followed by ``probe_periods`` of the other arm: while acting,
the other arm is a *control* held in shadow; while held, it is a *probe* that acts. The first period after
every switch is a washout (cache state and in-flight requests carry over) and is not judged. A judged
period contributes vLLM's mean TTFT over it (deltas of its histogram's ``_sum`` and ``_count``; fewer than
``min_requests`` requests: not judged). With at least ``min_periods`` judged periods of each arm among the
last ``history``, the difference of the arms' mean TTFTs gets a Welch 95 % interval:

* its lower bound above ``margin`` x the shadow mean: acting costs latency (``costly``); an acting guard
  holds (shadow, probes go on);
* its upper bound below ``margin`` x the shadow mean: acting does not cost latency (``fine``); a held
  guard acts again;
* otherwise ``undecided``: the state stays.

What it cannot see: a cost that outlives a washout period (cache contents acting left behind) is shared by
both arms, so it is under-estimated; it catches what acting costs while it acts (the layer's extra loads,
the sidecar's own calls). Pure: no I/O, no clock; units are seconds and requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from scipy import stats


@dataclass(slots=True)
class LatencyPeriod:
    """One closed period: the arm it ran, vLLM's requests and mean TTFT (s) in it, and how it counted."""

    acted: bool
    requests: float
    ttft_mean_s: float | None
    judged: bool
    why: str  # "judged" | "washout" | "too_few" | "reset" | "start"


@dataclass
class LatencyGuard:
    """See the module doc. ``acting``: the guard's state (False = held in shadow)."""

    act_periods: int = 4
    probe_periods: int = 2
    min_periods: int = 3
    history: int = 12
    min_requests: float = 20.0
    margin: float = 0.05
    acting: bool = True
    trips: int = 0
    resumes: int = 0
    verdict: str = "undecided"
    last_interval_s: tuple[float, float] | None = None  # 95 % interval of acting - shadow mean TTFT, s
    periods: dict[str, int] = field(default_factory=dict)  # why -> count
    _judged: dict[bool, deque[float]] = field(init=False)
    _slot: int = 0  # position in the current block (0 .. act_periods + probe_periods - 1)
    _prev: tuple[float, float] | None = None  # cumulative (TTFT sum s, count) at the period start
    _prev_arm: bool | None = None  # the arm of the previous period (None: none yet)

    def __post_init__(self) -> None:
        self._judged = {True: deque(maxlen=self.history), False: deque(maxlen=self.history)}

    def acts_now(self) -> bool:
        """Whether the current period acts: the guard's state, or the other arm in a block's last periods."""
        return self.acting if self._slot < self.act_periods else not self.acting

    def close(self, ttft_sum_s: float, ttft_count: float) -> LatencyPeriod:
        """Close the current period at vLLM's cumulative TTFT histogram (``_sum`` s, ``_count``), judge it,
        move to the next period; the caller acts in the next period iff :meth:`acts_now`."""
        arm = self.acts_now()
        prev, self._prev = self._prev, (ttft_sum_s, ttft_count)
        washout = self._prev_arm is not None and self._prev_arm != arm
        self._prev_arm = arm
        if prev is None:
            p = LatencyPeriod(arm, 0.0, None, False, "start")
        elif ttft_count < prev[1] or ttft_sum_s < prev[0]:
            p = LatencyPeriod(arm, 0.0, None, False, "reset")  # the engine restarted
        else:
            n, s = ttft_count - prev[1], ttft_sum_s - prev[0]
            mean = s / n if n > 0 else None
            if washout:
                p = LatencyPeriod(arm, n, mean, False, "washout")
            elif n < self.min_requests or mean is None:
                p = LatencyPeriod(arm, n, mean, False, "too_few")
            else:
                p = LatencyPeriod(arm, n, mean, True, "judged")
                self._judged[arm].append(mean)
        self.periods[p.why] = self.periods.get(p.why, 0) + 1
        if p.judged:
            self._decide()
        self._slot = (self._slot + 1) % (self.act_periods + self.probe_periods)
        return p

    def _decide(self) -> None:
        a, h = list(self._judged[True]), list(self._judged[False])
        if len(a) < self.min_periods or len(h) < self.min_periods:
            self.verdict = "undecided"
            return
        lo, hi = welch_interval(a, h)
        self.last_interval_s = (lo, hi)
        tol = self.margin * (sum(h) / len(h))
        self.verdict = "costly" if lo > tol else "fine" if hi < tol else "undecided"
        if self.acting and self.verdict == "costly":
            self.acting, self.trips = False, self.trips + 1
            self._slot = -1  # the next period starts a fresh block in the new state (-1 + 1 = 0)
        elif not self.acting and self.verdict == "fine":
            self.acting, self.resumes = True, self.resumes + 1
            self._slot = -1

    def status(self) -> dict[str, object]:
        mean = {arm: (sum(v) / len(v) if v else None) for arm, v in self._judged.items()}
        return {
            "acting": self.acting,
            "acts_this_period": self.acts_now(),
            "verdict": self.verdict,
            "trips": self.trips,
            "resumes": self.resumes,
            "judged_periods": {"acting": len(self._judged[True]), "shadow": len(self._judged[False])},
            "ttft_mean_s": {"acting": mean[True], "shadow": mean[False]},
            "acting_minus_shadow_ci95_s": list(self.last_interval_s) if self.last_interval_s else None,
            "periods": dict(self.periods),
        }


def welch_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float]:
    """``level`` interval of mean(a) - mean(b), Welch's unequal-variance t (two samples of >= 2 each)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    d = ma - mb
    if se2 <= 0.0:
        return d, d
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(se2)
    return d - half, d + half
