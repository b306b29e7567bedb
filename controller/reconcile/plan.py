"""Plan stage: the planner turns the view, pins and the policy's desired placement into moves."""

from __future__ import annotations

from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.pins import PinSet
from kvtier.controller.reconcile.context import StageFailed, TickContext
from kvtier.policies.planner import Planner


class PlanStage:
    """Runs the (loop-owned) planner; a failing plan is the stage's (the tick falls back to no action)."""

    def __init__(
        self, planner: Planner, pins: PinSet, pinned_at_layer: set[int], metrics: ControllerMetrics
    ) -> None:
        self.planner, self.pins, self.pinned_at_layer, self.metrics = planner, pins, pinned_at_layer, metrics

    def run(self, ctx: TickContext) -> None:
        """``ctx.plan``; the report's move count and the tried / deferred counters."""
        now, view = ctx.now, ctx.require_view()
        try:
            ctx.faults.inject("plan")
            pin_tokens = self.pins.tokens(now)
            desired = (
                None if ctx.desired is None or ctx.placement is None else {ctx.placement.tier: ctx.desired}
            )
            plan = self.planner.plan(
                view,
                now,
                pins=self.pins.block_map(now),
                pinned_at_layer=self.pinned_at_layer,
                pin_admittable=pin_tokens.keys(),
                desired=desired,
            )
        except Exception as exc:  # noqa: BLE001
            raise StageFailed("plan", "no_action", exc) from exc
        ctx.plan = ctx.rep.plan = plan
        ctx.rep.moves = len(plan.moves)
        for a, c in plan.tried.items():
            self.metrics.moves_tried.labels(action=a).inc(c)
        for a, c in plan.deferred.items():
            self.metrics.moves_deferred.labels(action=a).inc(c)
