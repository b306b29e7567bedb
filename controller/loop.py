"""The reconcile loop: observed state (the block index) + P(reuse) -> planned moves -> actuators.

Level-based, like a Kubernetes reconciler: each tick reads the index, asks the predictor and the planner
for the desired placement, and acts only on the difference; the planner assumes in-flight moves done, so a
repeated tick over unchanged state is a no-op. KV events only *wake* the loop (:meth:`ReconcileLoop.wake`);
state always comes from the index. A failing predictor falls back to the heuristic one, a failing observe
or plan stage to "no action"; each fallback is counted and the loop keeps running. Ticks have a timeout.

Cache layers that emulate pins (``refresh_pins()``, e.g. ``lmcache-mp``) get that call once per active
tick, and pins deleted through the API are forgotten at the layer (``unpin``). The index only sees vLLM's
own (GPU) residency, so the loop overlays what its applied actuations established in the layer's tiers
(pin/promote -> resident there, demote -> moved down, evict -> gone) on the observed tier mask.

Modes: ``off`` (observe only), ``shadow`` (decide, record, score counterfactually; the default) and
``active`` (decide and actuate; moves no configured actuator can do are recorded as shadow decisions).
Clock injected (seconds); the index keeps milliseconds (``index_ms_per_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from opentelemetry import trace
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
from kvtier.controller.decisions import Decision, DecisionLog, score
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.pins import PinSet
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.predict import ReusePredictor
from kvtier.controller.tokens import TokenStore
from kvtier.policies.heuristic import HeuristicPredictor
from kvtier.policies.index import BlockIndex
from kvtier.policies.planner import BlockView, Move, Plan, Planner, tier_bit
from kvtier.policies.slotmap import grown_size
from kvtier.policies.tiers import Tier

log = logging.getLogger(__name__)

# Predict-ahead (index-only predictors on a worker thread during observe): below 64 Ki rows the thread
# hand-off costs more than the prediction; and only with >= 4 cores: on 2 shared cores the worker slowed the
# observe phase by about what it saved (bench/control_tick at 1M rows, docs/perf/tick.md)
PREDICT_AHEAD_MIN_ROWS = 65_536
PREDICT_AHEAD_MIN_CORES = 4

ACTION_CAPABILITY: dict[str, Capability] = {
    "promote": Capability.PROMOTE,
    "demote": Capability.DEMOTE,
    "prefetch": Capability.PREFETCH,
    "admit": Capability.PREFETCH,  # admit = load / recompute into a tier: a prefetch for the layer
    "pin": Capability.PIN,
    "evict": Capability.EVICT,
}
_U64 = (1 << 64) - 1
# tiers an adapter can target when it does not say so itself (``tiers`` attribute)


def _tier_name(t: Tier | None) -> str | None:
    return t.value if t is not None else None


def block_key_hex(block: int) -> str:
    """The block hash as 16 lowercase hex digits (uint64 view of the int64 key)."""
    return f"{block & _U64:016x}"


@dataclass(slots=True)
class TickReport:
    tick: int
    at_s: float
    mode: str
    duration_s: float = 0.0
    outcome: str = "ok"  # ok | timeout | error | overlap
    moves: int = 0
    decisions: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    fallbacks: list[str] = field(default_factory=list)
    predictor: str = ""
    plan: Plan | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tick": self.tick,
            "at_s": self.at_s,
            "mode": self.mode,
            "duration_s": self.duration_s,
            "outcome": self.outcome,
            "moves": self.moves,
            "decisions": self.decisions,
            "outcomes": dict(self.outcomes),
            "fallbacks": self.fallbacks,
            "predictor": self.predictor,
            "tried": dict(self.plan.tried) if self.plan else {},
            "deferred": dict(self.plan.deferred) if self.plan else {},
            "held": dict(self.plan.held) if self.plan else {},
        }


class ReconcileLoop:
    """Owns the planner; everything else (index, pins, actuators, log, metrics, tracer, clock) is injected."""

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
    ) -> None:
        self.index = index
        self.policy = policy
        self._pending_policy: PolicyDoc | None = None
        self.actuators = list(actuators)
        self.pins = pins or PinSet()
        self.tokens = tokens or TokenStore()
        self.decisions = decisions or DecisionLog()
        self.metrics = metrics
        self.tracer = tracer or trace.get_tracer("kvtier.controller")
        self.clock = clock
        self.fallback: ReusePredictor = fallback or HeuristicPredictor(policy.predictor.tau_s * 1000.0)
        self.predictor: ReusePredictor = predictor or self.fallback
        self.model = model
        self.index_ms_per_s = index_ms_per_s
        self.max_score_per_tick = max_score_per_tick
        self._unscored_dropped_seen = 0  # decisions.report.unscored_dropped already counted in the metric
        self.assume_admittable = assume_admittable  # replay: any block can be re-created (recompute)
        self.planner = Planner(policy.planner_config())
        # the placement policy object (``--policy``): fed the inferred requests, its resident set is the
        # desired placement of its tier, its predictor gives P(reuse) (the ``predictor`` is the fallback)
        self.placement = placement
        # index-only predictors run on a worker thread during the observe phase from this many rows on
        self.predict_ahead_min_rows: int | None = (
            PREDICT_AHEAD_MIN_ROWS if (os.cpu_count() or 1) >= PREDICT_AHEAD_MIN_CORES else None
        )
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._desired: npt.NDArray[np.bool_] | None = None
        self._policy_rows: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._policy_q: npt.NDArray[np.floating[Any]] | None = None  # the policy's P(reuse) for _policy_rows
        self._policy_exc: BaseException | None = None
        self._policy_seen: npt.NDArray[np.bool_] = np.zeros(0, np.bool_)  # row -> fed to the policy
        self._policy_seen_of: object = None  # the policy object _policy_seen belongs to
        self._quality_at = -1  # policy retrains count when kvtier_predictor_auc was last set
        self.pinned_at_layer: set[int] = set()
        # block -> (actuator, ref) of pins a layer acknowledged (unpinned there when the pin goes away)
        self._layer_pins: dict[int, tuple[str, BlockRef, Tier]] = {}
        # block -> (bits of layer-managed tiers, bits resident there) learned from applied actuations
        self.layer_residency: dict[int, tuple[int, int]] = {}
        self.tick_no = 0
        self.last: TickReport | None = None
        self.errors: Counter[str] = Counter()
        self._busy = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._tokens_buf: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self._nbytes_buf: npt.NDArray[np.signedinteger[Any]] = np.zeros(0, np.int64)
        self._nbytes_key: tuple[Any, ...] | None = None  # (index, block_bytes, dtype) the buffer holds
        self._nbytes_version: int | None = None  # the index's nbytes_version when last refreshed
        self._nbytes_n = 0  # rows refreshed
        self._mask_buf: npt.NDArray[np.uint8] = np.zeros(0, np.uint8)
        self._p_buf: npt.NDArray[np.float32] = np.zeros(0, np.float32)
        self._p_owned = False  # is this tick's fallback P(reuse) array ours to overwrite (a fresh array)?
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.fault: dict[str, BaseException] = {}  # test hook: stage -> exception to raise (fault injection)
        metrics.init_layers(a.name for a in self.actuators)
        for a in self.actuators:  # actions outside the planner's: pin upkeep of emulated-pin layers
            extra = [act for act, ok in (("pin_refresh", a.refreshes_pins),
                                         ("unpin", a.supports(Capability.UNPIN))) if ok]  # fmt: skip
            for act_name in extra:
                for o in ("applied", "failed", "skipped"):
                    metrics.actuations.labels(layer=a.name, action=act_name, outcome=o)
        metrics.set_mode(policy.mode)

    # -- configuration -----------------------------------------------------------------------------------
    @property
    def next_policy(self) -> PolicyDoc:
        """The policy the next tick runs with (a pending swap, else the current one)."""
        return self._pending_policy or self.policy

    @property
    def mode(self) -> str:
        return self.next_policy.mode

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
        if self._wake is not None:
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

    def _fault(self, stage: str) -> None:
        exc = self.fault.get(stage)
        if exc is not None:
            raise exc

    def _tick(self) -> TickReport:
        self.commit_policy()
        self.tick_no += 1
        now = self.clock()
        rep = TickReport(self.tick_no, now, self.policy.mode)
        t0 = time.perf_counter()
        with self.tracer.start_as_current_span("kvtier.tick") as span:
            span.set_attribute("kvtier.tick", self.tick_no)
            span.set_attribute("kvtier.mode", self.policy.mode)
            try:
                with self.index.lock:  # the ingest path's bulk applies wait for the tick (they defer)
                    self._run_phases(now, rep)
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                rep.outcome = "error"
                self.errors[type(exc).__name__] += 1
                log.exception("tick %d failed", self.tick_no)
                span.record_exception(exc)
            if self.policy.mode != "off":
                with self._phase("act"):
                    self._maintain_layer_pins(now)
            span.set_attribute("kvtier.decisions", rep.decisions)
            span.set_attribute("kvtier.outcome", rep.outcome)
        rep.duration_s = time.perf_counter() - t0
        self.metrics.tick_seconds.observe(rep.duration_s)
        self.metrics.ticks.labels(outcome=rep.outcome).inc()
        self.metrics.last_tick.set(now)
        self.metrics.pins.set(sum(len(p.blocks) for p in self.pins.all()))
        for a in self.actuators:
            self.metrics.actuator_up.labels(layer=a.name).set(1.0 if a.health().breaker == "closed" else 0.0)
        self.last = rep
        return rep

    def _phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return _Phase(self, name)

    def _run_phases(self, now: float, rep: TickReport) -> None:
        self.pins.expire(now)
        if self.policy.mode == "off":
            pl = self._placement_or_none()
            if pl is not None:  # observe only: the policy keeps learning from the traffic
                try:
                    with pl.lock:
                        pl.observe()
                except Exception as exc:  # noqa: BLE001
                    pl.errors += 1
                    self._fallback(rep, "policy", "no_placement", exc)
            with self._phase("score"):
                self._score(now)
            return
        idx = self.index
        n = idx.n_rows
        ahead = self._predict_ahead(n, now)
        with self._phase("observe"):
            try:
                self._fault("observe")
                view = self._observe(n)
            except Exception as exc:  # noqa: BLE001
                self._fallback(rep, "observe", "no_action", exc)
                if ahead is not None:
                    ahead.cancel()
                    with contextlib.suppress(Exception):
                        ahead.result()  # the index must not be read after the tick (nor its error lost)
                return
            self._observe_policy(view, rep, now)
        with self._phase("predict"):
            p = self._predict(n, now, rep, ahead)
            if p is None:
                return
            view = BlockView(
                view.hashes,
                view.tier_mask,
                view.tokens,
                view.nbytes,
                p,
                self._admittable(view, p),
                view.lookup,
                view.lookup_many,
                view.epoch,
            )
        with self._phase("plan"):
            try:
                self._fault("plan")
                pin_tokens = self.pins.tokens(now)
                plan = self.planner.plan(
                    view,
                    now,
                    pins=self.pins.block_map(now),
                    pinned_at_layer=self.pinned_at_layer,
                    pin_admittable=pin_tokens.keys(),
                    desired=None
                    if self._desired is None or self.placement is None
                    else {self.placement.tier: self._desired},
                )
            except Exception as exc:  # noqa: BLE001
                self._fallback(rep, "plan", "no_action", exc)
                return
        rep.plan = plan
        rep.moves = len(plan.moves)
        for a, c in plan.tried.items():
            self.metrics.moves_tried.labels(action=a).inc(c)
        for a, c in plan.deferred.items():
            self.metrics.moves_deferred.labels(action=a).inc(c)
        with self._phase("act"):
            self._act(plan.moves, view, now, rep)
            # the in-flight window (hysteresis, pin retry) starts when the actuations returned: a slow
            # warm-up must not use up the time its KV events need to reach the index
            self.planner.commit(plan.moves, max(now, self.clock()))
        with self._phase("score"):
            self._score(now)

    def _fallback(self, rep: TickReport, stage: str, fallback: str, exc: BaseException) -> None:
        self.metrics.fallbacks.labels(stage=stage, fallback=fallback).inc()
        self.errors[f"{stage}:{type(exc).__name__}"] += 1
        rep.fallbacks.append(f"{stage}->{fallback}: {type(exc).__name__}: {exc}")
        log.warning(
            "tick %d: %s failed (%s: %s); fallback %s", self.tick_no, stage, type(exc).__name__, exc, fallback
        )

    def _observe(self, n: int | None = None) -> BlockView:
        idx = self.index
        if n is None:
            n = idx.n_rows
        bst = self.policy.block_size_tokens
        if self._tokens_buf.shape[0] != n or (n and int(self._tokens_buf[0]) != bst):
            # every row saves one block of tokens: a read-only broadcast (no 4 B/row array)
            self._tokens_buf = np.broadcast_to(np.int32(bst), (n,))
        # per-tick arrays in buffers kept across ticks (the tick is serial): fresh multi-MB allocations
        # each tick cost page faults, which on a loaded machine made single ticks 30+ ms slower
        nbytes = self._observe_nbytes(n)
        if self._mask_buf.shape[0] != n:
            self._mask_buf = np.zeros(n, np.uint8)
        mask = self._mask_buf
        np.copyto(mask, idx.tiers[:n])
        for h, (managed, bits) in list(self.layer_residency.items()):
            r = idx.slot_of(h)
            if 0 <= r < n:
                mask[r] = (int(mask[r]) & ~managed) | bits
        view = BlockView(
            hashes=idx.hash[:n],
            tier_mask=mask,
            tokens=self._tokens_buf,
            nbytes=nbytes,
            # placeholders until the predict phase builds the real view (read-only, no memory)
            p_reuse=np.broadcast_to(np.float32(0.0), (n,)),
            admittable=np.broadcast_to(np.False_, (n,)),
            lookup=idx.slot_of,
            lookup_many=idx.slots_of_keys,
            epoch=idx.epoch,
        )
        return view

    def _observe_nbytes(self, n: int) -> npt.NDArray[np.signedinteger[Any]]:
        """Block sizes of rows ``[0, n)``, unknown (<= 0) ones as ``block_bytes``: kept across ticks and
        refreshed only where the index logged a size change (and for new rows); all rows when the log
        does not reach back to the last tick, the index or ``block_bytes`` changed."""
        idx = self.index
        nb_all = idx.nbytes
        bb = int(self.policy.block_bytes)
        # the index's sizes are int32: so is the view's unless the default block size does not fit
        dt = np.int32 if nb_all.dtype == np.int32 and bb <= np.iinfo(np.int32).max else np.int64
        buf = self._nbytes_buf
        version = idx.nbytes_version
        key = (id(idx), bb, np.dtype(dt))
        changed = None
        last = self._nbytes_version
        if version is not None and last is not None and self._nbytes_key == key and self._nbytes_n <= n:
            changed = idx.nbytes_changed_since(last) if n <= buf.shape[0] else None
        if changed is None:  # everything
            if buf.shape[0] < n or buf.dtype != dt:  # exact size first, then grown steps as n grows
                grow = buf.dtype == dt and buf.shape[0] > 0
                buf = self._nbytes_buf = np.zeros(grown_size(buf.shape[0], n) if grow else n, dt)
            lo, rows = 0, np.zeros(0, np.intp)
        else:
            lo = self._nbytes_n
            rows = np.asarray(changed, np.intp)
            rows = rows[rows < lo]
        self._nbytes_key, self._nbytes_version, self._nbytes_n = key, version, n
        if rows.size:
            v = nb_all[rows]
            buf[rows] = np.where(v <= 0, bb, v)
        if lo < n:
            nb, out = nb_all[lo:n], buf[lo:n]
            if nb.dtype in (np.int32, np.int64) and bb >= 0:
                # max(nb, (nb <= 0) * bb): exact for bb >= 0, branch-free (a masked store over a random
                # mask is ~2 ms at 1M rows); the bool mask in the tier-mask buffer (overwritten next)
                if self._mask_buf.shape[0] < n:
                    self._mask_buf = np.zeros(n, np.uint8)
                unknown = np.less_equal(nb, 0, out=self._mask_buf[: n - lo].view(np.bool_))
                np.multiply(unknown, dt(bb), out=out)
                np.maximum(out, nb, out=out)
            else:
                np.copyto(out, nb, casting="unsafe")
                np.putmask(out, nb <= 0, bb)
        return buf[:n]

    def _observe_policy(self, view: BlockView, rep: TickReport, now: float) -> None:
        """Take the placement policy's resident set as the desired placement of its tier. The policy is fed
        as requests arrive (:meth:`PolicyPlacement.feed`); here only the still-queued rest is served. The
        policy's P(reuse) for the rows it cares about is taken under the same lock (a consistent snapshot).
        A failing policy: no desired placement this tick (counted)."""
        pl = self._placement_or_none()
        self._desired = None
        self._policy_rows = np.zeros(0, np.int64)
        self._policy_q = None
        self._policy_exc = None
        if pl is None:
            return
        try:
            self._fault("policy")
            with pl.lock:
                pl.observe()
                if pl.served == 0:
                    return  # nothing feeds the policy (yet): no opinion, the tier plans on the index alone
                lookup = view.lookup or self.index.slot_of
                n = len(view)
                want = pl.desired_mask(view.hashes, lookup, getattr(self.index, "epoch", None))
                here = (view.tier_mask & np.uint8(tier_bit(pl.tier))) != 0
                # scored by the policy: the rows its diff moves, and the blocks just requested
                # the policy can only score blocks it was fed: remember their rows (1 byte per row), so
                # the observed-but-unwanted rows it never saw are not looked up every tick
                trows = pl.touched_rows(view.hashes, lookup)
                seen = self._policy_seen_rows(pl, n)
                seen[trows] = True
                scored = (want ^ here) & (want | seen)
                scored[trows] = True
                rows = np.flatnonzero(scored)
                self._policy_rows = rows
                self._desired = want
                if rows.size:
                    try:
                        self._policy_q = pl.reuse_probability(view.hashes[rows], now * 1000.0, rows)
                    except Exception as exc:  # noqa: BLE001 - reported as a predict fallback
                        self._policy_exc = exc
        except Exception as exc:  # noqa: BLE001 - a policy bug must not kill the tick
            pl.errors += 1
            self._fallback(rep, "policy", "no_placement", exc)

    def _policy_seen_rows(self, pl: PolicyPlacement, n: int) -> npt.NDArray[np.bool_]:
        """Per index row: was its block ever fed to the current policy object (reset when it is replaced;
        a recycled row only costs an extra lookup)."""
        seen = self._policy_seen
        if self._policy_seen_of is not pl.policy:
            self._policy_seen_of = pl.policy
            seen = np.zeros(n, np.bool_)
        elif seen.shape[0] < n:
            seen = np.concatenate([seen, np.zeros(n - seen.shape[0], np.bool_)])
        self._policy_seen = seen
        return seen[:n]

    def _placement_or_none(self) -> PolicyPlacement | None:
        pl = self.placement
        if pl is None or self.placement_capacity() is None:
            return None
        return pl

    def _policy_p(self, p: npt.NDArray[np.float32], now: float, rep: TickReport) -> npt.NDArray[np.float32]:
        """Overwrite P(reuse) with the placement policy's own where it can score (the rows its diff moves,
        blocks requested since the last tick); the fallback predictor keeps the rest."""
        pl = self._placement_or_none()
        rows = self._policy_rows
        if pl is None or rows.size == 0:
            return p
        if self._policy_exc is not None:
            self._fallback(rep, "predict", rep.predictor or "heuristic", self._policy_exc)
            return p
        q = self._policy_q
        if q is None:
            return p
        ok = np.isfinite(q)
        if ok.any():
            if not self._p_owned:  # the predictor may keep its output: overwrite a copy
                if self._p_buf.shape[0] != p.shape[0]:
                    self._p_buf = np.zeros(p.shape[0], np.float32)
                np.copyto(self._p_buf, p)
                p = self._p_buf
            p[rows[ok]] = q[ok]  # (float32 already from learned; else cast on assignment)
            rep.predictor = f"policy:{pl.name}+{rep.predictor}"
        self._policy_quality_metric(pl)
        return p

    def _policy_quality_metric(self, pl: PolicyPlacement) -> None:
        """``kvtier_predictor_auc`` = the policy's own out-of-sample AUC, refreshed after its refits."""
        n = int(getattr(pl.policy, "retrains", 0))
        if n == self._quality_at:
            return
        self._quality_at = n
        q = pl.quality()
        if q and q.get("auc") is not None:
            self.metrics.predictor_auc.set(float(q["auc"]))

    def _predict_ahead(self, n: int, now: float) -> Future[Any] | None:
        """Start the predictor on a worker thread while the observe phase runs, when it only reads the
        index (``reads_index_only``; numpy releases the GIL in its passes): on a free core its ~5-10 ms
        at 1M blocks overlap the policy's work. Its result or error is taken in the predict phase, exactly
        as a direct call's."""
        pr = self.predictor
        least = self.predict_ahead_min_rows
        if least is None or n < least or not getattr(pr, "reads_index_only", False):
            return None
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-predict")
        return self._ahead_pool.submit(pr.predict, self.index, n, now * self.index_ms_per_s)

    def _predict(
        self, n: int, now: float, rep: TickReport, ahead: Future[Any] | None = None
    ) -> npt.NDArray[np.float32] | None:
        p = self._predict_fallback(n, now, rep, ahead)
        return None if p is None else self._policy_p(p, now, rep)

    def _predict_fallback(
        self, n: int, now: float, rep: TickReport, ahead: Future[Any] | None = None
    ) -> npt.NDArray[np.float32] | None:
        now_ms = now * self.index_ms_per_s
        self._p_owned = False
        try:
            self._fault("predict")
            p = ahead.result() if ahead is not None else self.predictor.predict(self.index, n, now_ms)
            rep.predictor = self.predictor.name
            return self._own(self.predictor, p)
        except Exception as exc:  # noqa: BLE001
            if self.predictor is self.fallback:
                self._fallback(rep, "predict", "no_action", exc)
                return None
            self._fallback(rep, "predict", "heuristic", exc)
        try:
            p = self.fallback.predict(self.index, n, now_ms)
            rep.predictor = self.fallback.name
            return self._own(self.fallback, p)
        except Exception as exc:  # noqa: BLE001
            self._fallback(rep, "predict", "no_action", exc)
            return None

    def _own(self, predictor: ReusePredictor, p: Any) -> npt.NDArray[np.float32]:
        """``p`` as float32; notes whether the tick may overwrite it in place (a new array: converted here,
        or from a predictor whose ``returns_new_array`` says it keeps no reference)."""
        out = np.asarray(p, np.float32)
        self._p_owned = out is not p or bool(getattr(predictor, "returns_new_array", False))
        return out

    def _admittable(self, view: BlockView, p: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
        """Non-resident blocks whose chain tokens are known (checked for the likeliest candidates only)."""
        if self.assume_admittable:
            return np.ones(len(view), np.bool_)
        adm = np.zeros(len(view), np.bool_)
        if len(self.tokens) == 0 or not self._admits_possible():
            return adm
        cand = np.flatnonzero((view.tier_mask == 0) & (p >= self.policy.reuse_threshold))
        if cand.size > 4096:
            cand = cand[np.argpartition(-p[cand], 4095)[:4096]]
        for r in cand.tolist():
            if int(view.hashes[r]) in self.tokens:
                adm[r] = True
        return adm

    def _admits_possible(self) -> bool:
        """Active mode plans admissions only when an actuator can re-create blocks (vllm-warmup) or records
        everything (shadow); otherwise those infeasible moves would crowd feasible ones out of the budget
        (an admit's gain is the whole prefill, a disk -> cpu promote's only the load-time difference)."""
        if self.policy.mode != "active":
            return True
        return any(a.recreates or a.records_only for a in self.actuators)

    # -- acting --------------------------------------------------------------------------------------------
    def _actuator_for(self, m: Move) -> Actuator | None:
        """First configured actuator that advertises the action for the move's target tier. ``admit`` (a
        block resident nowhere) needs an adapter that can re-create it (``recreates``: vllm-warmup)."""
        cap = ACTION_CAPABILITY[m.action]
        for a in self.actuators:
            if not a.supports(cap):
                continue
            if m.action == "admit" and not a.recreates:
                continue
            tiers = self._tiers_of(a)
            # both ends of the move must be the layer's (a gpu -> cpu demote is not LMCache's to make)
            ends = [t for t in ((m.src, m.dst) if m.action != "evict" else (m.src,)) if t is not None]
            if m.action == "pin":
                ends = [m.dst] if m.dst is not None else []
            if tiers is not None and not all(t in tiers for t in ends):
                continue
            return a
        return None

    @staticmethod
    def _tiers_of(a: Actuator) -> frozenset[Tier] | None:
        return a.tiers

    def _learn_residency(self, act: Actuator, m: Move) -> None:
        """Overlay the effect of an applied move in the layer's own tiers (the index cannot see them)."""
        tiers = self._tiers_of(act)
        if not tiers:
            return
        managed = 0
        for t in tiers:
            managed |= tier_bit(t)
        _, bits = self.layer_residency.get(m.block, (managed, 0))
        if m.action in ("demote", "evict") and m.src is not None and m.src in tiers:
            bits &= ~tier_bit(m.src)
        elif m.action == "evict":
            bits = 0
        if m.action != "evict" and m.dst is not None and m.dst in tiers:
            bits |= tier_bit(m.dst)
        if bits:
            self.layer_residency[m.block] = (managed, bits)
        else:
            self.layer_residency.pop(m.block, None)

    def _ref(self, m: Move, pin_tokens: dict[int, Any]) -> BlockRef:
        toks: tuple[int, ...] | None = None
        pt = pin_tokens.get(m.block)
        if pt is not None:
            toks = pt[0].tokens_for(pt[1])
        if toks is None:
            toks = self.tokens.chain_tokens(m.block)
        return BlockRef(layer_key=block_key_hex(m.block), model=self.model, token_ids=toks)

    def _act(self, moves: list[Move], view: BlockView, now: float, rep: TickReport) -> None:
        if not moves:
            return
        pin_tokens = self.pins.tokens(now)
        active = self.policy.mode == "active"
        groups: dict[tuple[str, str, Tier | None, Tier | None], list[tuple[Move, Decision, BlockRef]]] = {}
        # per-decision counter increments, summed and applied once per label set after the loop (same
        # totals; a locked inc() per decision cost ~3 us each)
        tally: Counter[tuple[Any, tuple[str, ...]]] = Counter()
        try:
            self._decide(moves, view, now, rep, active, pin_tokens, groups, tally)
        finally:
            for (metric, labels), k in tally.items():
                self._child(metric, *labels).inc(k)
        self._actuate(groups, rep)

    def _decide(
        self,
        moves: list[Move],
        view: BlockView,
        now: float,
        rep: TickReport,
        active: bool,
        pin_tokens: dict[int, Any],
        groups: dict[tuple[str, str, Tier | None, Tier | None], list[tuple[Move, Decision, BlockRef]]],
        tally: Counter[tuple[Any, tuple[str, ...]]],
    ) -> None:
        """One :class:`Decision` per move: recorded at once when nothing applies it (shadow), else queued
        in its actuator group. Counter increments go to ``tally``."""
        if not moves:
            return
        rows = np.asarray(self._rows_of_moves(moves, view), np.int64)
        ok = np.flatnonzero(rows >= 0)
        # per-move scalars in two vectorised gathers (untracked blocks, e.g. a pinned prefix vLLM has not
        # stored yet: freq0 -1, p_reuse 1.0)
        freq0_of = np.full(rows.shape[0], -1, np.int64)
        p_of = np.ones(rows.shape[0], np.float64)
        if ok.size:
            freq0_of[ok] = self.index.freq[rows[ok]]
            p_of[ok] = view.p_reuse[rows[ok]]
        freq0s, ps = freq0_of.tolist(), p_of.tolist()
        ids = self.decisions.new_ids(len(moves))
        tick, tokens = self.tick_no, self.policy.block_size_tokens
        shadow: list[Decision] = []
        per_label: Counter[tuple[str, str]] = Counter()
        detail = "shadow mode" if not active else "no actuator supports it"
        try:
            for m, i, f0, pr in zip(moves, ids, freq0s, ps, strict=True):
                act = self._actuator_for(m) if active else None
                t = m.dst or m.src
                v = m.value_s
                d = Decision(
                    id=i,
                    tick=tick,
                    at_s=now,
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
                ref = self._ref(m, pin_tokens)
                groups.setdefault((act.name, m.action, m.src, m.dst), []).append((m, d, ref))
        finally:  # what was decided is recorded and counted even if a later move fails
            if shadow:
                self.decisions.add_many(shadow)
                rep.outcomes["shadow"] += len(shadow)
            for (action, tier), c in per_label.items():
                tally[(self.metrics.decisions, (action, tier))] += c
            for action, c in Counter(d.action for d in shadow).items():
                tally[(self.metrics.decision_outcomes, (action, "shadow"))] += c
                tally[(self.metrics.actuations, ("shadow", action, "shadow"))] += c

    @staticmethod
    def _rows_of_moves(moves: list[Move], view: BlockView) -> list[int]:
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

    def _actuate(
        self,
        groups: dict[tuple[str, str, Tier | None, Tier | None], list[tuple[Move, Decision, BlockRef]]],
        rep: TickReport,
    ) -> None:
        """One actuator call per (layer, action, src, dst) group; record each decision's outcome."""
        by_name = {a.name: a for a in self.actuators}
        for (name, action, src, dst), items in groups.items():
            act = by_name[name]
            with self.tracer.start_as_current_span("kvtier.actuate") as span:
                span.set_attribute("kvtier.layer", name)
                span.set_attribute("kvtier.action", action)
                span.set_attribute("kvtier.tier", _tier_name(dst or src) or "none")
                span.set_attribute("kvtier.blocks", len(items))
                span.set_attribute("kvtier.decision_ids", [d.id for _, d, _ in items])
                t0 = time.perf_counter()
                refs = [ref for _, _, ref in items]
                if act.token_addressed and len(refs) > 1:
                    # one call per ref: the layer's keys are chunks of each ref's prefix, and a batched
                    # call would leave nothing for the per-ref attribution below to observe
                    outcomes = {
                        rf.layer_key: _aggregate(rf.layer_key, self._call(act, action, src, dst, [rf]))
                        for rf in refs
                    }
                    res = None
                else:
                    res = self._call(act, action, src, dst, refs)
                    outcomes = res.by_key()
                if res is not None and not all(rf.layer_key in outcomes for rf in refs):
                    # the layer reports its own keys (e.g. LMCache chunks): attribute them ref by ref
                    outcomes = {}
                    for rf in refs:
                        one = res if len(refs) == 1 else self._call(act, action, src, dst, [rf])
                        outcomes[rf.layer_key] = _aggregate(rf.layer_key, one)
                self.metrics.actuation_seconds.labels(layer=name).observe(time.perf_counter() - t0)
                counts: Counter[str] = Counter()
                for m, d, ref in items:
                    o = outcomes.get(ref.layer_key)
                    d.outcome = (
                        o.outcome if o is not None and o.outcome in ACTUATION_OUTCOMES else Outcome.FAILED
                    )
                    if act.records_only and d.outcome != "failed":
                        d.outcome = Outcome.SHADOW
                    d.detail = o.detail if o else "no outcome for key"
                    counts[d.outcome] += 1
                    self.metrics.actuations.labels(layer=name, action=action, outcome=d.outcome).inc()
                    if d.outcome == "applied":
                        self.metrics.moves_applied.labels(action=action).inc()
                        self._learn_residency(act, m)
                    elif (
                        d.outcome == "skipped"
                        and action in ("demote", "evict")
                        and "not present" in (d.detail or "")
                    ):
                        # the layer had no copy there any more (another ref of the chain freed the shared
                        # chunk, or the layer evicted it): the desired state holds, do not plan it again
                        self._learn_residency(act, m)
                    if action == "pin" and d.outcome in ("applied", "skipped"):
                        # skipped = nothing for the layer to hold (e.g. shorter than one LMCache chunk)
                        self.pinned_at_layer.add(m.block)
                        self._layer_pins[m.block] = (name, ref, m.dst or Tier.CPU)
                    self._record(d, rep)
                for k, v in counts.items():
                    span.set_attribute(f"kvtier.outcome.{k}", v)

    def _maintain_layer_pins(self, now: float) -> None:
        """Forget pins the operator removed (``unpin`` at the layer); in active mode, let layers that
        emulate pins re-assert them (``refresh_pins()``: re-loads what the layer evicted under pressure)."""
        by_name = {a.name: a for a in self.actuators}
        if self._layer_pins:
            wanted = self.pins.block_map(now)
            gone: dict[tuple[str, Tier], list[tuple[int, BlockRef]]] = {}
            for b, (name, ref, tier) in list(self._layer_pins.items()):
                if b not in wanted:
                    gone.setdefault((name, tier), []).append((b, ref))
            for (name, tier), items in gone.items():
                act = by_name.get(name)
                for b, _ in items:
                    self._layer_pins.pop(b, None)
                    self.pinned_at_layer.discard(b)
                if act is None or not act.supports(Capability.UNPIN):
                    continue
                try:
                    res = act.unpin([ref for _, ref in items], tier)
                except Exception as exc:  # noqa: BLE001
                    self.errors[f"unpin:{type(exc).__name__}"] += 1
                    log.warning("actuator %s unpin failed: %s", name, exc)
                    continue
                for o in res.outcomes:
                    self._child(self.metrics.actuations, name, "unpin", o.outcome.value).inc()
        if self.policy.mode != "active":
            return
        for act in self.actuators:
            if not act.refreshes_pins:
                continue
            refresh = act.refresh_pins
            with self.tracer.start_as_current_span("kvtier.actuate") as span:
                span.set_attribute("kvtier.layer", act.name)
                span.set_attribute("kvtier.action", "pin_refresh")
                t0 = time.perf_counter()
                try:
                    res = refresh()
                except Exception as exc:  # noqa: BLE001 - an adapter bug must not kill the tick
                    self.errors[f"pin_refresh:{type(exc).__name__}"] += 1
                    log.warning("actuator %s refresh_pins failed: %s", act.name, exc)
                    continue
                if not res.outcomes:
                    continue
                self.metrics.actuation_seconds.labels(layer=act.name).observe(time.perf_counter() - t0)
                counts = Counter(o.outcome.value for o in res.outcomes)
                for k, v in counts.items():
                    self._child(self.metrics.actuations, act.name, "pin_refresh", k).inc(v)
                    span.set_attribute(f"kvtier.outcome.{k}", v)

    def _call(
        self, act: Actuator, action: str, src: Tier | None, dst: Tier | None, refs: list[BlockRef]
    ) -> ActuationResult:
        try:
            self._fault("act")
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
            self.errors[f"act:{type(exc).__name__}"] += 1
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

    def _record(
        self, d: Decision, rep: TickReport, tally: Counter[tuple[Any, tuple[str, ...]]] | None = None
    ) -> None:
        self.decisions.add(d)
        rep.outcomes[d.outcome] += 1
        if tally is None:
            self._child(self.metrics.decision_outcomes, d.action, d.outcome).inc()
        else:
            tally[(self.metrics.decision_outcomes, (d.action, d.outcome))] += 1

    # -- counterfactual scoring ----------------------------------------------------------------------------
    def _score(self, now: float) -> None:
        horizon = self.policy.shadow_horizon_s
        idx = self.index
        dropped = self.decisions.report.unscored_dropped
        if dropped > self._unscored_dropped_seen:
            self.metrics.shadow_unscored_dropped.inc(dropped - self._unscored_dropped_seen)
            self._unscored_dropped_seen = dropped
        due = self.decisions.due(now - horizon, self.max_score_per_tick)
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


def _aggregate(key: str, res: ActuationResult) -> KeyOutcome:
    """One outcome for a ref from the per-layer-key outcomes of a call about that ref alone."""
    if not res.outcomes:
        return KeyOutcome(key, Outcome.FAILED, "no outcome reported")
    worst = (Outcome.FAILED if res.count(Outcome.FAILED) else
             Outcome.APPLIED if res.count(Outcome.APPLIED) else Outcome.SKIPPED)  # fmt: skip
    detail = "; ".join(f"{o.key}: {o.outcome.value} {o.detail}".strip() for o in res.outcomes[:4])
    return KeyOutcome(key, worst, detail[:300])


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
