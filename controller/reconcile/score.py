"""Score stage: counterfactual scoring of decisions whose shadow horizon has passed.

A decision is scored by whether its block came back (the index's access count moved) within
``shadow_horizon_s`` (seconds) of the decision; at most ``max_per_tick`` per tick.
"""

from __future__ import annotations

from collections import Counter

from kvtier.controller.decisions import DecisionLog, score
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.reconcile.context import TickContext


class ScoreStage:
    """Scores due decisions and keeps the shadow metrics."""

    def __init__(self, decisions: DecisionLog, metrics: ControllerMetrics, *, max_per_tick: int) -> None:
        self.decisions, self.metrics, self.max_per_tick = decisions, metrics, max_per_tick
        self._unscored_dropped_seen = 0  # decisions.report.unscored_dropped already counted in the metric

    def run(self, ctx: TickContext) -> None:
        now, idx = ctx.now, ctx.index
        horizon = ctx.policy.shadow_horizon_s
        dropped = self.decisions.report.unscored_dropped
        if dropped > self._unscored_dropped_seen:
            self.metrics.shadow_unscored_dropped.inc(dropped - self._unscored_dropped_seen)
            self._unscored_dropped_seen = dropped
        due = self.decisions.due(now - horizon, self.max_per_tick)
        if not due:
            return
        for d in due:
            s = idx.slot_of(d.block)
            ok = s >= 0 and int(idx.hash[s]) == d.block
            score(d, int(idx.freq[s]) if ok else None, now, horizon)
        self.decisions.mark_scored(due)
        m = self.metrics
        for (action, tier), n in Counter((d.action, d.tier or "none") for d in due).items():
            m.shadow_scored.labels(action=action, tier=tier).inc(n)
        hits = [d for d in due if d.came_back and d.score and d.score > 0]
        for (action, tier), n in Counter((d.action, d.tier or "none") for d in hits).items():
            m.shadow_hits.labels(action=action, tier=tier).inc(n)
        m.shadow_tokens.inc(sum(d.tokens for d in hits))
        m.shadow_regrets.inc(sum(1 for d in due if d.came_back and not (d.score and d.score > 0)))
