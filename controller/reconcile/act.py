"""Act stage: one :class:`Decision` per planned move, routed to the first actuator that can make it.

Moves no configured actuator can do (and every move outside ``active`` mode) are recorded as shadow
decisions. One actuator call per (layer, action, src, dst) group; each decision gets its per-key
outcome, and applied moves update the layer-residency overlay. Layers that emulate pins
(``refreshes_pins``) get ``refresh_pins()`` once per active tick, and pins removed through the API are
released at the layer (``unpin``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from opentelemetry.trace import Tracer

from kvtier.controller.actuators.base import (
    ACTUATION_OUTCOMES,
    ActuationResult,
    Actuator,
    BlockRef,
    Capability,
    KeyOutcome,
    Outcome,
)
from kvtier.controller.decisions import Decision, DecisionLog
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.pins import PinSet
from kvtier.controller.reconcile.context import StageFaults, TickContext, TickReport
from kvtier.controller.reconcile.residency import LayerState
from kvtier.controller.tokens import TokenStore
from kvtier.policies.planner import BlockView, Move, Planner
from kvtier.policies.tiers import Tier

log = logging.getLogger("kvtier.controller.loop")  # one logger for the whole tick

ACTION_CAPABILITY: dict[str, Capability] = {
    "promote": Capability.PROMOTE,
    "demote": Capability.DEMOTE,
    "prefetch": Capability.PREFETCH,
    "admit": Capability.PREFETCH,  # admit = load / recompute into a tier: a prefetch for the layer
    "pin": Capability.PIN,
    "evict": Capability.EVICT,
}
_U64 = (1 << 64) - 1
Group = tuple[str, str, Tier | None, Tier | None]  # (layer, action, src, dst)
Queued = list[tuple[Move, Decision, BlockRef]]
Tally = Counter[tuple[Any, tuple[str, ...]]]


def block_key_hex(block: int) -> str:
    """The block hash as 16 lowercase hex digits (uint64 view of the int64 key)."""
    return f"{block & _U64:016x}"


class ActStage:
    """Decides, routes and records; keeps the labelled-metric children it increments per decision."""

    def __init__(
        self,
        *,
        planner: Planner,
        pins: PinSet,
        tokens: TokenStore,
        decisions: DecisionLog,
        layers: LayerState,
        metrics: ControllerMetrics,
        tracer: Tracer,
        faults: StageFaults,
        clock: Callable[[], float],
        model: str,
    ) -> None:
        self.planner, self.pins, self.tokens, self.decisions = planner, pins, tokens, decisions
        self.layers, self.metrics, self.tracer, self.faults = layers, metrics, tracer, faults
        self.clock, self.model = clock, model
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def init_metrics(self, actuators: Sequence[Actuator]) -> None:
        """Zero the per-layer series, including the actions outside the planner's (pin upkeep)."""
        self.metrics.init_layers(a.name for a in actuators)
        for a in actuators:
            extra = [act for act, ok in (("pin_refresh", a.refreshes_pins),
                                         ("unpin", a.supports(Capability.UNPIN))) if ok]  # fmt: skip
            for act_name in extra:
                for o in ("applied", "failed", "skipped"):
                    self.metrics.actuations.labels(layer=a.name, action=act_name, outcome=o)

    def run(self, ctx: TickContext) -> None:
        """Act on ``ctx.plan``; then commit it to the planner (its in-flight window starts now)."""
        plan, view = ctx.plan, ctx.require_view()
        assert plan is not None  # the plan stage ran
        self.act(plan.moves, view, ctx)
        # the in-flight window (hysteresis, pin retry) starts when the actuations returned: a slow
        # warm-up must not use up the time its KV events need to reach the index
        self.planner.commit(plan.moves, max(ctx.now, self.clock()))

    def act(self, moves: list[Move], view: BlockView, ctx: TickContext) -> None:
        if not moves:
            return
        pin_tokens = self.pins.tokens(ctx.now)
        groups: dict[Group, Queued] = {}
        # per-decision counter increments, summed and applied once per label set after the loop (same
        # totals; a locked inc() per decision cost ~3 us each)
        tally: Tally = Counter()
        try:
            self._decide(moves, view, ctx, pin_tokens, groups, tally)
        finally:
            for (metric, labels), k in tally.items():
                self._child(metric, *labels).inc(k)
        by_name = {a.name: a for a in ctx.actuators}
        for group, items in groups.items():
            self._actuate(by_name[group[0]], group, items, ctx.rep)

    def _decide(
        self,
        moves: list[Move],
        view: BlockView,
        ctx: TickContext,
        pin_tokens: dict[int, Any],
        groups: dict[Group, Queued],
        tally: Tally,
    ) -> None:
        """One :class:`Decision` per move: recorded at once when nothing applies it (shadow), else queued
        in its actuator group. Counter increments go to ``tally``."""
        rows = np.asarray(rows_of_moves(moves, view), np.int64)
        ok = np.flatnonzero(rows >= 0)
        # per-move scalars in two vectorised gathers (untracked blocks, e.g. a pinned prefix vLLM has not
        # stored yet: freq0 -1, p_reuse 1.0)
        freq0_of = np.full(rows.shape[0], -1, np.int64)
        p_of = np.ones(rows.shape[0], np.float64)
        if ok.size:
            freq0_of[ok] = ctx.index.freq[rows[ok]]
            p_of[ok] = view.p_reuse[rows[ok]]
        freq0s, ps = freq0_of.tolist(), p_of.tolist()
        ids = self.decisions.new_ids(len(moves))
        active = ctx.policy.mode == "active"
        tick, tokens, rep = ctx.rep.tick, ctx.policy.block_size_tokens, ctx.rep
        shadow: list[Decision] = []
        per_label: Counter[tuple[str, str]] = Counter()
        detail = "shadow mode" if not active else "no actuator supports it"
        try:
            for m, i, f0, pr in zip(moves, ids, freq0s, ps, strict=True):
                act = actuator_for(m, ctx.actuators) if active else None
                t = m.dst or m.src
                v = m.value_s
                d = Decision(
                    id=i,
                    tick=tick,
                    at_s=ctx.now,
                    action=m.action,
                    block=m.block,
                    src=m.src.value if m.src else None,
                    tier=t.value if t is not None else None,
                    value_s=v if math.isfinite(v) else 1e9,
                    p_reuse=pr,
                    pinned=m.pinned,
                    layer=act.name if act else "shadow",
                    tokens=tokens,
                    freq0=f0,
                )
                per_label[(m.action, d.tier or "none")] += 1
                rep.decisions += 1
                if act is None:
                    d.outcome = Outcome.SHADOW
                    d.detail = detail
                    shadow.append(d)
                    continue
                groups.setdefault((act.name, m.action, m.src, m.dst), []).append(
                    (m, d, self._ref(m, pin_tokens))
                )
        finally:  # what was decided is recorded and counted even if a later move fails
            if shadow:
                self.decisions.add_many(shadow)
                rep.outcomes["shadow"] += len(shadow)
            for (action, tier), c in per_label.items():
                tally[(self.metrics.decisions, (action, tier))] += c
            for action, c in Counter(d.action for d in shadow).items():
                tally[(self.metrics.decision_outcomes, (action, "shadow"))] += c
                tally[(self.metrics.actuations, ("shadow", action, "shadow"))] += c

    def _ref(self, m: Move, pin_tokens: dict[int, Any]) -> BlockRef:
        toks: tuple[int, ...] | None = None
        pt = pin_tokens.get(m.block)
        if pt is not None:
            toks = pt[0].tokens_for(pt[1])
        if toks is None:
            toks = self.tokens.chain_tokens(m.block)
        return BlockRef(layer_key=block_key_hex(m.block), model=self.model, token_ids=toks)

    def _actuate(self, act: Actuator, group: Group, items: Queued, rep: TickReport) -> None:
        """One actuator call for a (layer, action, src, dst) group; record each decision's outcome."""
        name, action, src, dst = group
        with self.tracer.start_as_current_span("kvtier.actuate") as span:
            span.set_attribute("kvtier.layer", name)
            span.set_attribute("kvtier.action", action)
            t = dst or src
            span.set_attribute("kvtier.tier", t.value if t is not None else "none")
            span.set_attribute("kvtier.blocks", len(items))
            span.set_attribute("kvtier.decision_ids", [d.id for _, d, _ in items])
            t0 = time.perf_counter()
            outcomes = self._outcomes(act, action, src, dst, [ref for _, _, ref in items])
            self.metrics.actuation_seconds.labels(layer=name).observe(time.perf_counter() - t0)
            counts: Counter[str] = Counter()
            for m, d, ref in items:
                o = outcomes.get(ref.layer_key)
                d.outcome = o.outcome if o is not None and o.outcome in ACTUATION_OUTCOMES else Outcome.FAILED
                if act.records_only and d.outcome != "failed":
                    d.outcome = Outcome.SHADOW
                d.detail = o.detail if o else "no outcome for key"
                counts[d.outcome] += 1
                self.metrics.actuations.labels(layer=name, action=action, outcome=d.outcome).inc()
                self._learn(act, m, d, ref)
                self._record(d, rep)
            for k, v in counts.items():
                span.set_attribute(f"kvtier.outcome.{k}", v)

    def _outcomes(
        self, act: Actuator, action: str, src: Tier | None, dst: Tier | None, refs: list[BlockRef]
    ) -> dict[str, KeyOutcome]:
        """Per-ref outcome of acting on ``refs`` (one call, or one per ref where the layer's keys differ)."""
        if act.token_addressed and len(refs) > 1:
            # one call per ref: the layer's keys are chunks of each ref's prefix, and a batched
            # call would leave nothing for the per-ref attribution below to observe
            return {
                rf.layer_key: aggregate(rf.layer_key, self._call(act, action, src, dst, [rf])) for rf in refs
            }
        res = self._call(act, action, src, dst, refs)
        outcomes = res.by_key()
        if not all(rf.layer_key in outcomes for rf in refs):
            # the layer reports its own keys (e.g. LMCache chunks): attribute them ref by ref
            outcomes = {}
            for rf in refs:
                one = res if len(refs) == 1 else self._call(act, action, src, dst, [rf])
                outcomes[rf.layer_key] = aggregate(rf.layer_key, one)
        return outcomes

    def _learn(self, act: Actuator, m: Move, d: Decision, ref: BlockRef) -> None:
        """What an outcome tells about the layer's residency and pins."""
        if d.outcome == "applied":
            self.metrics.moves_applied.labels(action=d.action).inc()
            self.layers.learn(act, m)
        elif d.outcome == "skipped" and d.action in ("demote", "evict") and "not present" in (d.detail or ""):
            # the layer had no copy there any more (another ref of the chain freed the shared
            # chunk, or the layer evicted it): the desired state holds, do not plan it again
            self.layers.learn(act, m)
        if d.action == "pin" and d.outcome in ("applied", "skipped"):
            # skipped = nothing for the layer to hold (e.g. shorter than one LMCache chunk)
            self.layers.pinned(m.block, act.name, ref, m.dst or Tier.CPU)

    def maintain_layer_pins(self, ctx: TickContext) -> None:
        """Forget pins the operator removed (``unpin`` at the layer); in active mode, let layers that
        emulate pins re-assert them (``refresh_pins()``: re-loads what the layer evicted under pressure)."""
        self._release_removed_pins(ctx)
        if ctx.policy.mode != "active":
            return
        for act in ctx.actuators:
            if act.refreshes_pins:
                self._refresh_pins(act)

    def _release_removed_pins(self, ctx: TickContext) -> None:
        layer_pins = self.layers.layer_pins
        if not layer_pins:
            return
        by_name = {a.name: a for a in ctx.actuators}
        wanted = self.pins.block_map(ctx.now)
        gone: dict[tuple[str, Tier], list[tuple[int, BlockRef]]] = {}
        for b, (name, ref, tier) in list(layer_pins.items()):
            if b not in wanted:
                gone.setdefault((name, tier), []).append((b, ref))
        for (name, tier), items in gone.items():
            act = by_name.get(name)
            for b, _ in items:
                self.layers.forget_pin(b)
            if act is None or not act.supports(Capability.UNPIN):
                continue
            try:
                res = act.unpin([ref for _, ref in items], tier)
            except Exception as exc:  # noqa: BLE001
                self.faults.errors[f"unpin:{type(exc).__name__}"] += 1
                log.warning("actuator %s unpin failed: %s", name, exc)
                continue
            for o in res.outcomes:
                self._child(self.metrics.actuations, name, "unpin", o.outcome.value).inc()

    def _refresh_pins(self, act: Actuator) -> None:
        with self.tracer.start_as_current_span("kvtier.actuate") as span:
            span.set_attribute("kvtier.layer", act.name)
            span.set_attribute("kvtier.action", "pin_refresh")
            t0 = time.perf_counter()
            try:
                res = act.refresh_pins()
            except Exception as exc:  # noqa: BLE001 - an adapter bug must not kill the tick
                self.faults.errors[f"pin_refresh:{type(exc).__name__}"] += 1
                log.warning("actuator %s refresh_pins failed: %s", act.name, exc)
                return
            if not res.outcomes:
                return
            self.metrics.actuation_seconds.labels(layer=act.name).observe(time.perf_counter() - t0)
            counts = Counter(o.outcome.value for o in res.outcomes)
            for k, v in counts.items():
                self._child(self.metrics.actuations, act.name, "pin_refresh", k).inc(v)
                span.set_attribute(f"kvtier.outcome.{k}", v)

    def _call(
        self, act: Actuator, action: str, src: Tier | None, dst: Tier | None, refs: list[BlockRef]
    ) -> ActuationResult:
        try:
            self.faults.inject("act")
            if action in ("prefetch", "admit"):
                assert dst is not None
                return act.prefetch(refs, dst)
            if action == "promote":
                assert dst is not None
                return act.promote(refs, dst)
            if action == "demote":
                assert dst is not None
                return act.demote(refs, dst)
            if action == "pin":
                assert dst is not None
                return act.pin(refs, dst)
            if action == "evict":
                return act.evict(refs, src)
            raise ValueError(f"unknown action {action!r}")
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not kill the tick
            self.faults.errors[f"act:{type(exc).__name__}"] += 1
            self.metrics.fallbacks.labels(stage="act", fallback="no_action").inc()
            log.warning("actuator %s %s failed: %s", act.name, action, exc)
            return ActuationResult(
                act.name,
                action,
                [KeyOutcome(r.layer_key, Outcome.FAILED, f"{type(exc).__name__}: {exc}") for r in refs],
            )

    def _child(self, metric: Any, *labels: str) -> Any:
        """Cached labelled child (``labels()`` is too slow for the per-decision path)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def _record(self, d: Decision, rep: TickReport) -> None:
        self.decisions.add(d)
        rep.outcomes[d.outcome] += 1
        self._child(self.metrics.decision_outcomes, d.action, d.outcome).inc()


def actuator_for(m: Move, actuators: Sequence[Actuator]) -> Actuator | None:
    """First actuator that advertises the action for the move's target tier. ``admit`` (a block resident
    nowhere) needs an adapter that can re-create it (``recreates``: vllm-warmup)."""
    cap = ACTION_CAPABILITY[m.action]
    for a in actuators:
        if not a.supports(cap):
            continue
        if m.action == "admit" and not a.recreates:
            continue
        tiers = a.tiers
        # both ends of the move must be the layer's (a gpu -> cpu demote is not LMCache's to make)
        ends = [t for t in ((m.src, m.dst) if m.action != "evict" else (m.src,)) if t is not None]
        if m.action == "pin":
            ends = [m.dst] if m.dst is not None else []
        if tiers is not None and not all(t in tiers for t in ends):
            continue
        return a
    return None


def rows_of_moves(moves: list[Move], view: BlockView) -> list[int]:
    """Index row of each move's block (-1: not in the view's index): one vectorised lookup when the
    view has one, else ``view.lookup`` per block."""
    if view.lookup_many is not None:
        try:
            keys = np.array([m.block for m in moves], dtype=np.int64)
        except OverflowError:  # a block key outside int64 (cannot be in the index's int64 table)
            pass
        else:
            return [int(r) for r in view.lookup_many(keys).tolist()]
    if view.lookup is None:
        return [-1] * len(moves)
    return [view.lookup(m.block) for m in moves]


def aggregate(key: str, res: ActuationResult) -> KeyOutcome:
    """One outcome for a ref from the per-layer-key outcomes of a call about that ref alone."""
    if not res.outcomes:
        return KeyOutcome(key, Outcome.FAILED, "no outcome reported")
    worst = (Outcome.FAILED if res.count(Outcome.FAILED) else
             Outcome.APPLIED if res.count(Outcome.APPLIED) else Outcome.SKIPPED)  # fmt: skip
    detail = "; ".join(f"{o.key}: {o.outcome.value} {o.detail}".strip() for o in res.outcomes[:4])
    return KeyOutcome(key, worst, detail[:300])
