"""Predict stage: the fallback predictor's P(reuse) per row, and which rows could be admitted.

An index-only predictor (``reads_index_only``) may run on a worker thread while the observe stage runs
(numpy releases the GIL in its passes): on a free core its ~5-10 ms at 1M blocks overlap the policy's
work. The worker reads the :class:`BlockIndex` without taking ``BlockIndex.lock`` itself -- it cannot: the
lock is an RLock the tick thread holds for the whole tick, and the tick waits for the worker. That is
what makes the read safe: the ingest path's bulk applies cannot take the lock while the tick holds it
(they defer), and :meth:`PredictStage.settle` joins the worker before the tick releases the lock, on
every path (result taken, stage failed, tick error).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.actuators.base import Actuator
from kvtier.controller.predict import ReusePredictor
from kvtier.controller.reconcile.context import StageFailed, TickContext
from kvtier.controller.tokens import TokenStore
from kvtier.policies.planner import BlockView

# Predict-ahead (index-only predictors on a worker thread during observe): below 64 Ki rows the thread
# hand-off costs more than the prediction; and only with >= 4 cores: on 2 shared cores the worker slowed the
# observe phase by about what it saved (bench/control_tick at 1M rows, docs/perf/tick.md)
PREDICT_AHEAD_MIN_ROWS = 65_536
PREDICT_AHEAD_MIN_CORES = 4
ADMIT_CANDIDATES = 4096  # rows checked for known chain tokens per tick (the likeliest non-resident ones)


def default_ahead_min_rows() -> int | None:
    """Rows from which the predictor runs ahead on a worker (None: never, too few cores)."""
    return PREDICT_AHEAD_MIN_ROWS if (os.cpu_count() or 1) >= PREDICT_AHEAD_MIN_CORES else None


class PredictStage:
    """P(reuse) from the configured predictor, the heuristic on its failure; the admittable rows."""

    def __init__(self, tokens: TokenStore, *, index_ms_per_s: float, assume_admittable: bool) -> None:
        self.tokens = tokens
        self.index_ms_per_s = index_ms_per_s
        self.assume_admittable = assume_admittable  # replay: any block can be re-created (recompute)
        self.pool: ThreadPoolExecutor | None = None  # the predict-ahead worker (created on first use)
        self.last_owned = False  # was the last tick's P(reuse) a fresh array (overwritten in place)?

    def start_ahead(self, ctx: TickContext, least: int | None) -> None:
        """Start the predictor on the worker when it only reads the index and there are >= ``least`` rows;
        its result or error is taken in :meth:`run`, exactly as a direct call's."""
        pr = ctx.predictor
        if least is None or ctx.n < least or not getattr(pr, "reads_index_only", False):
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-predict")
        ctx.ahead = self.pool.submit(pr.predict, ctx.index, ctx.n, ctx.now * self.index_ms_per_s)

    @staticmethod
    def settle(ctx: TickContext) -> None:
        """Join the worker (the index must not be read after the tick releases its lock; its error, if
        not taken by :meth:`run`, is dropped: the tick already fell back)."""
        ahead, ctx.ahead = ctx.ahead, None
        if ahead is not None:
            ahead.cancel()
            with contextlib.suppress(Exception):
                ahead.result()

    def run(self, ctx: TickContext) -> None:
        """``ctx.p`` from the predictor (or the worker's result); on its failure the fallback's (counted);
        both failing: the stage fails (no action)."""
        now_ms = ctx.now * self.index_ms_per_s
        ctx.p_owned = False
        pr, rep = ctx.predictor, ctx.rep
        try:
            ctx.faults.inject("predict")
            ahead, ctx.ahead = ctx.ahead, None
            p = ahead.result() if ahead is not None else pr.predict(ctx.index, ctx.n, now_ms)
            rep.predictor = pr.name
            self._own(ctx, pr, p)
            return
        except Exception as exc:  # noqa: BLE001
            if pr is ctx.fallback_predictor:
                raise StageFailed("predict", "no_action", exc) from exc
            ctx.fallback("predict", "heuristic", exc)
        fb = ctx.fallback_predictor
        try:
            p = fb.predict(ctx.index, ctx.n, now_ms)
            rep.predictor = fb.name
            self._own(ctx, fb, p)
        except Exception as exc:  # noqa: BLE001
            raise StageFailed("predict", "no_action", exc) from exc

    def _own(self, ctx: TickContext, predictor: ReusePredictor, p: Any) -> None:
        """``ctx.p`` = ``p`` as float32; notes whether the tick may overwrite it in place (a new array:
        converted here, or from a predictor whose ``returns_new_array`` says it keeps no reference)."""
        out = np.asarray(p, np.float32)
        ctx.p = out
        ctx.p_owned = self.last_owned = out is not p or bool(getattr(predictor, "returns_new_array", False))

    def finish_view(self, ctx: TickContext) -> None:
        """The view with the real P(reuse) (after the policy overlay) and the admittable rows."""
        view, p = ctx.require_view(), ctx.p
        assert p is not None  # run() set it or failed
        self.last_owned = ctx.p_owned
        ctx.view = BlockView(
            view.hashes,
            view.tier_mask,
            view.tokens,
            view.nbytes,
            p,
            self.admittable(view, p, ctx),
            view.lookup,
            view.lookup_many,
            view.epoch,
        )

    def admittable(
        self, view: BlockView, p: npt.NDArray[np.float32], ctx: TickContext
    ) -> npt.NDArray[np.bool_]:
        """Non-resident blocks whose chain tokens are known (checked for the likeliest candidates only)."""
        if self.assume_admittable:
            return np.ones(len(view), np.bool_)
        adm = np.zeros(len(view), np.bool_)
        if len(self.tokens) == 0 or not admits_possible(ctx.policy.mode, ctx.actuators):
            return adm
        cand = np.flatnonzero((view.tier_mask == 0) & (p >= ctx.policy.reuse_threshold))
        if cand.size > ADMIT_CANDIDATES:
            cand = cand[np.argpartition(-p[cand], ADMIT_CANDIDATES - 1)[:ADMIT_CANDIDATES]]
        for r in cand.tolist():
            if int(view.hashes[r]) in self.tokens:
                adm[r] = True
        return adm


def admits_possible(mode: str, actuators: Sequence[Actuator]) -> bool:
    """Active mode plans admissions only when an actuator can re-create blocks (vllm-warmup) or records
    everything (shadow); otherwise those infeasible moves would crowd feasible ones out of the budget
    (an admit's gain is the whole prefill, a disk -> cpu promote's only the load-time difference)."""
    if mode != "active":
        return True
    return any(a.recreates or a.records_only for a in actuators)
