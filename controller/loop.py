"""The reconcile loop: observed state (the block index) + P(reuse) -> planned moves -> actuators.

Level-based, like a Kubernetes reconciler: each tick reads the index, asks the predictor and the planner
for the desired placement, and acts only on the difference; the planner assumes in-flight moves done, so a
repeated tick over unchanged state is a no-op. KV events only *wake* the loop (:meth:`ReconcileLoop.wake`);
state always comes from the index. Ticks have a timeout.

:class:`ReconcileLoop` only sequences the stages of :mod:`kvtier.controller.reconcile` (observe ->
overlay -> predict -> plan -> act -> score, one :class:`TickContext` per tick), times them (a span and
``kvtier_loop_phase_seconds`` per phase) and maps their failures to outcomes: a stage that raises
:class:`StageFailed` ends the tick with its counted fallback (``no_action``); a failing predictor falls
back to the heuristic and a failing placement policy to no desired placement inside their stages; any
other exception makes the tick's outcome ``error``. The loop keeps running either way.

Modes: ``off`` (observe only), ``shadow`` (decide, record, score counterfactually; the default) and
``active`` (decide and actuate; moves no configured actuator can do are recorded as shadow decisions).
Clock injected (seconds); the index keeps milliseconds (``index_ms_per_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from kvtier.controller.actuators.base import Actuator
from kvtier.controller.decisions import DecisionLog
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.pins import PinSet
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.predict import ReusePredictor
from kvtier.controller.reconcile.act import ActStage, block_key_hex
from kvtier.controller.reconcile.context import StageFailed, StageFaults, TickContext, TickReport, log
from kvtier.controller.reconcile.observe import ObserveStage
from kvtier.controller.reconcile.overlay import OverlayStage
from kvtier.controller.reconcile.plan import PlanStage
from kvtier.controller.reconcile.predict import PredictStage, default_ahead_min_rows
from kvtier.controller.reconcile.residency import LayerState
from kvtier.controller.reconcile.score import ScoreStage
from kvtier.controller.tokens import TokenStore
from kvtier.policies.heuristic import HeuristicPredictor
from kvtier.policies.index import BlockIndex
from kvtier.policies.planner import Planner

__all__ = ["ReconcileLoop", "Stages", "TickReport", "block_key_hex"]


@dataclass(slots=True)
class Stages:
    """The tick's stages, in the order they run."""

    observe: ObserveStage
    overlay: OverlayStage
    predict: PredictStage
    plan: PlanStage
    act: ActStage
    score: ScoreStage


class ReconcileLoop:
    """Owns the planner and the stages; everything else (index, pins, actuators, log, metrics, tracer,
    clock) is injected."""

    def __init__(
        self,
        index: BlockIndex,
        *,
        policy: PolicyDoc,
        actuators: Sequence[Actuator] = (),
        pins: PinSet | None = None,
        tokens: TokenStore | None = None,
        decisions: DecisionLog | None = None,
        metrics: ControllerMetrics,
        tracer: Tracer | None = None,
        clock: Callable[[], float] = time.time,
        predictor: ReusePredictor | None = None,
        fallback: ReusePredictor | None = None,
        model: str = "",
        index_ms_per_s: float = 1000.0,
        max_score_per_tick: int = 20_000,
        assume_admittable: bool = False,
        placement: PolicyPlacement | None = None,
        plans: bool = True,
    ) -> None:
        self.index, self.policy, self.actuators = index, policy, list(actuators)
        # False when another decider owns the layer (the lmcache-l1 keeper) and no planner actuator exists:
        # tier moves no one can execute would only cost CPU beside the engine and misreport what the sidecar
        # does, so the loop then observes and scores only (as in mode off) and KV events do not wake it
        self.plans = plans
        self._pending_policy: PolicyDoc | None = None
        self.pins, self.tokens = pins or PinSet(), tokens or TokenStore()
        self.decisions, self.metrics, self.clock = decisions or DecisionLog(), metrics, clock
        self.tracer = tracer or trace.get_tracer("kvtier.controller")
        self.fallback: ReusePredictor = fallback or HeuristicPredictor(policy.predictor.tau_s * 1000.0)
        self.predictor: ReusePredictor = predictor or self.fallback
        self.model, self.index_ms_per_s, self.max_score_per_tick = model, index_ms_per_s, max_score_per_tick
        self.assume_admittable = assume_admittable  # replay: any block can be re-created (recompute)
        self.planner = Planner(policy.planner_config())
        # the placement policy object (``--policy``): fed the inferred requests, its resident set is the
        # desired placement of its tier, its predictor gives P(reuse) (the ``predictor`` is the fallback)
        self.placement = placement
        # index-only predictors run on a worker thread during the observe phase from this many rows on
        self.predict_ahead_min_rows: int | None = default_ahead_min_rows()
        self.tick_no = 0
        self.last: TickReport | None = None
        self.errors: Counter[str] = Counter()
        self.fault: dict[str, BaseException] = {}  # test hook: stage -> exception to raise (fault injection)
        self.faults = StageFaults(metrics, self.errors, self.fault)
        self.layers = LayerState()
        self.stages = self._build_stages()
        self._busy = threading.Lock()
        self._wake: asyncio.Event | None = None
        self.stages.act.init_metrics(self.actuators)
        metrics.set_mode(policy.mode)

    def _build_stages(self) -> Stages:
        act = ActStage(
            planner=self.planner, pins=self.pins, tokens=self.tokens, decisions=self.decisions,
            layers=self.layers, metrics=self.metrics, tracer=self.tracer, faults=self.faults,
            clock=self.clock, model=self.model,
        )  # fmt: skip
        return Stages(
            observe=ObserveStage(self.layers),
            overlay=OverlayStage(self.metrics),
            predict=PredictStage(
                self.tokens, index_ms_per_s=self.index_ms_per_s, assume_admittable=self.assume_admittable
            ),
            plan=PlanStage(self.planner, self.pins, self.layers.pinned_at_layer, self.metrics),
            act=act,
            score=ScoreStage(self.decisions, self.metrics, max_per_tick=self.max_score_per_tick),
        )

    # -- configuration -----------------------------------------------------------------------------------
    @property
    def next_policy(self) -> PolicyDoc:
        """The policy the next tick runs with (a pending swap, else the current one)."""
        return self._pending_policy or self.policy

    @property
    def mode(self) -> str:
        return self.next_policy.mode

    @property
    def pinned_at_layer(self) -> set[int]:
        """Blocks a cache layer holds pinned (the planner leaves them alone)."""
        return self.layers.pinned_at_layer

    @property
    def layer_residency(self) -> dict[int, tuple[int, int]]:
        """block -> (bits of layer-managed tiers, bits resident there), from applied actuations."""
        return self.layers.residency

    def set_policy(self, doc: PolicyDoc) -> None:
        """Swap the policy at the next tick boundary (never mid-tick)."""
        self._pending_policy = doc
        self.metrics.set_mode(doc.mode)

    def commit_policy(self) -> None:
        """Apply a pending :meth:`set_policy` now (done at each tick boundary; wiring calls it at start)."""
        doc, self._pending_policy = self._pending_policy, None
        if doc is None:
            return
        self.policy = doc
        self.planner.reconfigure(doc.planner_config())
        if isinstance(self.fallback, HeuristicPredictor):
            self.fallback.tau_ms = doc.predictor.tau_s * 1000.0
        if self.placement is not None:
            cap = self.placement_capacity(doc)
            if cap is not None:
                self.placement.resize(cap)

    def placement_capacity(self, doc: PolicyDoc | None = None) -> int | None:
        """Blocks of the placement policy's tier in the policy document (None: tier not managed)."""
        if self.placement is None:
            return None
        for t in (doc or self.policy).tiers:
            if t.tier is self.placement.tier:
                return t.capacity_blocks
        return None

    def wake(self) -> None:
        """Ask for an early tick (KV events call this; they never carry state into the loop)."""
        if self._wake is not None and self.plans:
            self._wake.set()

    # -- one tick ----------------------------------------------------------------------------------------
    def tick(self) -> TickReport:
        """Run one reconcile pass synchronously (the async runner calls it in a worker thread)."""
        if not self._busy.acquire(blocking=False):
            self.metrics.ticks.labels(outcome="overlap").inc()
            return TickReport(self.tick_no, self.clock(), self.mode, outcome="overlap")
        try:
            return self._tick()
        finally:
            self._busy.release()

    def _context(self) -> TickContext:
        """A new tick's context: the configuration as of now (a swap waits for the next tick)."""
        self.commit_policy()
        self.tick_no += 1
        now = self.clock()
        placement = self.placement if self.placement_capacity() is not None else None
        return TickContext(
            now=now, policy=self.policy, rep=TickReport(self.tick_no, now, self.policy.mode),
            index=self.index, faults=self.faults, actuators=list(self.actuators), predictor=self.predictor,
            fallback_predictor=self.fallback, placement=placement,
        )  # fmt: skip

    def _tick(self) -> TickReport:
        ctx = self._context()
        rep = ctx.rep
        t0 = time.perf_counter()
        with self.tracer.start_as_current_span("kvtier.tick") as span:
            span.set_attribute("kvtier.tick", self.tick_no)
            span.set_attribute("kvtier.mode", ctx.policy.mode)
            try:
                with self.index.lock:  # the ingest path's bulk applies wait for the tick (they defer)
                    self._run_stages(ctx)
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                rep.outcome = "error"
                self.errors[type(exc).__name__] += 1
                log.exception("tick %d failed", self.tick_no)
                span.record_exception(exc)
            if ctx.policy.mode != "off":
                with self._phase("act"):
                    self.stages.act.maintain_layer_pins(ctx)
            span.set_attribute("kvtier.decisions", rep.decisions)
            span.set_attribute("kvtier.outcome", rep.outcome)
        rep.duration_s = time.perf_counter() - t0
        self._tick_metrics(rep)
        self.last = rep
        return rep

    def _tick_metrics(self, rep: TickReport) -> None:
        self.metrics.tick_seconds.observe(rep.duration_s)
        self.metrics.ticks.labels(outcome=rep.outcome).inc()
        self.metrics.last_tick.set(rep.at_s)
        self.metrics.pins.set(sum(len(p.blocks) for p in self.pins.all()))
        for a in self.actuators:
            self.metrics.actuator_up.labels(layer=a.name).set(1.0 if a.health().breaker == "closed" else 0.0)

    def _phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return _Phase(self, name)

    def _run_stages(self, ctx: TickContext) -> None:
        """The stages in order, each phase timed; a :class:`StageFailed` ends the tick with its fallback."""
        st = self.stages
        self.pins.expire(ctx.now)
        if ctx.policy.mode == "off" or not self.plans:  # observe only: the policy keeps learning
            st.overlay.observe_only(ctx)
            with self._phase("score"):
                st.score.run(ctx)
            return
        ctx.n = self.index.n_rows
        st.predict.start_ahead(ctx, self.predict_ahead_min_rows)
        phases: tuple[tuple[str, tuple[Callable[[TickContext], None], ...]], ...] = (
            ("observe", (st.observe.run, st.overlay.run)),
            ("predict", (st.predict.run, st.overlay.blend, st.predict.finish_view)),
            ("plan", (st.plan.run,)),
            ("act", (st.act.run,)),
            ("score", (st.score.run,)),
        )
        try:
            for name, steps in phases:
                with self._phase(name):
                    if not self._run_steps(ctx, steps):
                        return
        finally:
            st.predict.settle(ctx)  # the worker never reads the index after the tick releases its lock

    def _run_steps(self, ctx: TickContext, steps: Sequence[Callable[[TickContext], None]]) -> bool:
        """Run one phase's steps; False (fallback counted) when one raised :class:`StageFailed`."""
        try:
            for step in steps:
                step(ctx)
        except StageFailed as failed:
            self.faults.fallback(ctx.rep, failed.stage, failed.fallback, failed.cause)
            return False
        return True

    # -- running ---------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, min_interval_s: float = 0.05) -> None:
        """Tick every ``tick_interval_s`` (sooner when woken, at most every ``min_interval_s``) till stop."""
        self._wake = asyncio.Event()
        while not stop.is_set():
            started = time.monotonic()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.tick), timeout=self.policy.tick_timeout_s)
            except TimeoutError:
                self.metrics.ticks.labels(outcome="timeout").inc()
                self.errors["timeout"] += 1
                log.warning("tick timed out after %.1f s", self.policy.tick_timeout_s)
            wait = max(min_interval_s, self.policy.tick_interval_s - (time.monotonic() - started))
            await self._feed_backlog(started + wait)
            wait = max(0.0, started + wait - time.monotonic())
            waker = asyncio.ensure_future(self._wake.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waker, stopper}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for f in (waker, stopper):
                f.cancel()
            self._wake.clear()

    async def _feed_backlog(self, deadline: float, chunk: int = 16) -> None:
        """Between ticks: serve requests the ingest path left queued (it is bounded per batch), in small
        chunks that yield to the event loop, until the queue is empty or ``deadline`` (monotonic s)."""
        pl = self.placement
        while pl is not None and len(pl.requests) and time.monotonic() < deadline:
            if pl.feed(chunk) == 0:
                break
            await asyncio.sleep(0)

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "plans": self.plans,
            "tick": self.tick_no,
            "last_tick": self.last.to_dict() if self.last else None,
            "actuators": [
                {
                    "name": a.name,
                    "capabilities": sorted(c.value for c in a.capabilities()),
                    "health": {
                        "breaker": (h := a.health()).breaker,
                        "consecutive_failures": h.consecutive_failures,
                        "last_error": h.last_error,
                    },
                }
                for a in self.actuators
            ],
            "pins": len(self.pins),
            "decisions": len(self.decisions),
            "shadow": self.decisions.report.to_dict(),
            "errors": dict(self.errors),
            "predictor": self.predictor.info(),
            "placement": self.placement.info() if self.placement is not None else None,
            "planner": {"budgets": self.planner.budget_state()},
        }


class _Phase:
    """Child span + phase histogram for one tick phase."""

    def __init__(self, loop: ReconcileLoop, name: str) -> None:
        self.loop, self.name = loop, name
        self._cm: Any = None
        self._t0 = 0.0

    def __enter__(self) -> _Phase:
        self._cm = self.loop.tracer.start_as_current_span(f"kvtier.{self.name}")
        self._cm.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.metrics.phase_seconds.labels(phase=self.name).observe(time.perf_counter() - self._t0)
        self._cm.__exit__(*exc)
