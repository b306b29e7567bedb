"""The controller's own Prometheus metrics (loop, planner, decisions, actuations, predictor, shadow).

One :class:`ControllerMetrics` per injected ``CollectorRegistry``; every label series is created at zero
on construction so dashboards never show "no data".
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.controller.decisions import OUTCOMES
from kvtier.policies.planner import ACTIONS
from kvtier.policies.tiers import TIER_ORDER

TIER_LABELS = tuple(t.value for t in TIER_ORDER) + ("none",)
MODES = ("off", "shadow", "active")
TICK_OUTCOMES = ("ok", "timeout", "error", "overlap")
ACT_OUTCOMES = ("applied", "failed", "skipped", "shadow")


class LazyGauge:
    """A label-less gauge registered on its first :meth:`set`, so the series is absent (not 0) until a
    value exists."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.registry = name, documentation, registry
        self._gauge: Gauge | None = None

    def set(self, value: float) -> None:
        if self._gauge is None:
            self._gauge = Gauge(self.name, self.documentation, registry=self.registry)
        self._gauge.set(value)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry, layers: Iterable[str] = ()) -> None:
        r = registry
        self.tick_seconds = Histogram(
            "kvtier_loop_tick_seconds",
            "Reconcile tick duration, seconds.",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.phase_seconds = Histogram(
            "kvtier_loop_phase_seconds",
            "Duration of one tick phase, seconds.",
            ["phase"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0),
        )
        self.ticks = Counter("kvtier_loop_ticks", "Reconcile ticks by outcome.", ["outcome"], registry=r)
        self.fallbacks = Counter(
            "kvtier_loop_fallbacks",
            "Ticks that fell back because a stage failed.",
            ["stage", "fallback"],
            registry=r,
        )
        self.last_tick = Gauge(
            "kvtier_loop_last_tick_timestamp_seconds", "Clock time of the last tick.", registry=r
        )
        self.decisions = Counter("kvtier_decisions", "Decisions made.", ["action", "tier"], registry=r)
        self.decision_outcomes = Counter(
            "kvtier_decision_outcomes", "Decisions by final outcome.", ["action", "outcome"], registry=r
        )
        self.actuations = Counter(
            "kvtier_actuations", "Per-key actuation outcomes.", ["layer", "action", "outcome"], registry=r
        )
        self.actuation_seconds = Histogram(
            "kvtier_actuation_seconds", "Duration of one actuator call, seconds.", ["layer"], registry=r
        )
        self.actuator_up = Gauge(
            "kvtier_actuator_up", "1 when the actuator's circuit breaker is closed.", ["layer"], registry=r
        )
        self.moves_tried = Counter(
            "kvtier_planner_moves_tried", "Moves that qualified.", ["action"], registry=r
        )
        self.moves_applied = Counter(
            "kvtier_planner_moves_applied", "Moves the cache layer applied.", ["action"], registry=r
        )
        self.moves_deferred = Counter(
            "kvtier_planner_moves_deferred", "Moves cut by a link budget.", ["action"], registry=r
        )
        # absent until the first fit: an AUC of 0 before any training would read as a broken model
        self.predictor_auc = LazyGauge(
            "kvtier_predictor_auc", "Reuse predictor ROC AUC on held-out data.", registry=r
        )
        self.predictor_samples = LazyGauge(
            "kvtier_predictor_training_samples", "Predictor training set size.", registry=r
        )
        self.shadow_hits = Counter(
            "kvtier_shadow_hits",
            "Scored decisions whose move would have produced a hit.",
            ["action", "tier"],
            registry=r,
        )
        self.shadow_regrets = Counter(
            "kvtier_shadow_regrets", "Downward decisions whose block came back (would-be misses).", registry=r
        )
        self.shadow_scored = Counter(
            "kvtier_shadow_scored", "Decisions scored counterfactually.", ["action", "tier"], registry=r
        )
        self.shadow_unscored_dropped = Counter(
            "kvtier_shadow_unscored_dropped",
            "Decisions dropped unscored to keep the pending queue bounded.",
            registry=r,
        )
        self.shadow_tokens = Counter(
            "kvtier_shadow_hit_tokens", "Prefill tokens the would-be hits save.", registry=r
        )
        self.pins = Gauge("kvtier_pins", "Active pins (blocks).", registry=r)
        self.mode = Gauge("kvtier_policy_mode", "1 for the current mode.", ["mode"], registry=r)
        for ph in ("observe", "predict", "plan", "act", "score"):
            self.phase_seconds.labels(phase=ph)
        for o in TICK_OUTCOMES:
            self.ticks.labels(outcome=o)
        for st, fb in (
            ("observe", "no_action"),
            ("predict", "heuristic"),
            ("predict", "no_action"),
            ("plan", "no_action"),
            ("act", "no_action"),
        ):
            self.fallbacks.labels(stage=st, fallback=fb)
        for a in ACTIONS:
            self.moves_tried.labels(action=a)
            self.moves_applied.labels(action=a)
            self.moves_deferred.labels(action=a)
            for t in TIER_LABELS:
                self.decisions.labels(action=a, tier=t)
                self.shadow_scored.labels(action=a, tier=t)
                self.shadow_hits.labels(action=a, tier=t)
            for o in OUTCOMES:
                self.decision_outcomes.labels(action=a, outcome=o)
        self.init_layers(layers)
        for m in MODES:
            self.mode.labels(mode=m)

    def init_layers(self, layers: Iterable[str]) -> None:
        for layer in (*layers, "shadow"):
            self.actuator_up.labels(layer=layer)
            self.actuation_seconds.labels(layer=layer)
            for a in ACTIONS:
                for o in ACT_OUTCOMES:
                    self.actuations.labels(layer=layer, action=a, outcome=o)

    def set_mode(self, mode: str) -> None:
        for m in MODES:
            self.mode.labels(mode=m).set(1.0 if m == mode else 0.0)
