"""Overlay stage: the placement policy's opinion on top of the index.

The placement policy (``--policy``) is fed the inferred requests as they arrive
(:meth:`PolicyPlacement.feed`); here only the still-queued rest is served. Its resident set becomes the
desired placement of its tier, and its own P(reuse) replaces the fallback predictor's on the rows it can
score (the rows its diff moves, the blocks just requested). A failing policy: no desired placement this
tick (counted), the tier plans on the index alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.reconcile.context import TickContext
from kvtier.policies.planner import tier_bit


class OverlayStage:
    """Desired placement and policy P(reuse) per tick; remembers which rows the policy was fed."""

    def __init__(self, metrics: ControllerMetrics) -> None:
        self.metrics = metrics
        self._seen: npt.NDArray[np.bool_] = np.zeros(0, np.bool_)  # row -> fed to the policy
        self._seen_of: object = None  # the policy object _seen belongs to
        self._quality_at = -1  # policy retrains count when kvtier_predictor_auc was last set
        self._p_buf: npt.NDArray[np.float32] = np.zeros(0, np.float32)

    def observe_only(self, ctx: TickContext) -> None:
        """Mode ``off``: the policy keeps learning from the traffic, nothing else."""
        pl = ctx.placement
        if pl is None:
            return
        try:
            with pl.lock:
                pl.observe()
        except Exception as exc:  # noqa: BLE001
            pl.errors += 1
            ctx.fallback("policy", "no_placement", exc)

    def run(self, ctx: TickContext) -> None:
        """``ctx.desired``, ``ctx.policy_rows`` and the policy's P(reuse) for them (``ctx.policy_q``),
        taken under the policy's lock (a consistent snapshot)."""
        pl = ctx.placement
        if pl is None:
            return
        view = ctx.require_view()
        try:
            ctx.faults.inject("policy")
            with pl.lock:
                pl.observe()
                if pl.served == 0:
                    return  # nothing feeds the policy (yet): no opinion, the tier plans on the index alone
                lookup = view.lookup or ctx.index.slot_of
                want = pl.desired_mask(view.hashes, lookup, getattr(ctx.index, "epoch", None))
                here = (view.tier_mask & np.uint8(tier_bit(pl.tier))) != 0
                # scored by the policy: the rows its diff moves, and the blocks just requested
                # the policy can only score blocks it was fed: remember their rows (1 byte per row), so
                # the observed-but-unwanted rows it never saw are not looked up every tick
                trows = pl.touched_rows(view.hashes, lookup)
                seen = self._seen_rows(pl, len(view))
                seen[trows] = True
                scored = (want ^ here) & (want | seen)
                scored[trows] = True
                rows = np.flatnonzero(scored)
                ctx.policy_rows = rows
                ctx.desired = want
                if rows.size:
                    try:
                        ctx.policy_q = pl.reuse_probability(view.hashes[rows], ctx.now * 1000.0, rows)
                    except Exception as exc:  # noqa: BLE001 - reported as a predict fallback
                        ctx.policy_exc = exc
        except Exception as exc:  # noqa: BLE001 - a policy bug must not kill the tick
            pl.errors += 1
            ctx.fallback("policy", "no_placement", exc)

    def _seen_rows(self, pl: PolicyPlacement, n: int) -> npt.NDArray[np.bool_]:
        """Per index row: was its block ever fed to the current policy object (reset when it is replaced;
        a recycled row only costs an extra lookup)."""
        seen = self._seen
        if self._seen_of is not pl.policy:
            self._seen_of = pl.policy
            seen = np.zeros(n, np.bool_)
        elif seen.shape[0] < n:
            seen = np.concatenate([seen, np.zeros(n - seen.shape[0], np.bool_)])
        self._seen = seen
        return seen[:n]

    def blend(self, ctx: TickContext) -> None:
        """Overwrite ``ctx.p`` with the policy's P(reuse) where it can score; the fallback predictor keeps
        the rest (in a copy unless ``ctx.p_owned``)."""
        pl, rows, p, rep = ctx.placement, ctx.policy_rows, ctx.p, ctx.rep
        if pl is None or rows.size == 0 or p is None:
            return
        if ctx.policy_exc is not None:
            ctx.fallback("predict", rep.predictor or "heuristic", ctx.policy_exc)
            return
        q = ctx.policy_q
        if q is None:
            return
        ok = np.isfinite(q)
        if ok.any():
            if not ctx.p_owned:  # the predictor may keep its output: overwrite a copy
                if self._p_buf.shape[0] != p.shape[0]:
                    self._p_buf = np.zeros(p.shape[0], np.float32)
                np.copyto(self._p_buf, p)
                p = ctx.p = self._p_buf
            p[rows[ok]] = q[ok]  # (float32 already from learned; else cast on assignment)
            rep.predictor = f"policy:{pl.name}+{rep.predictor}"
        self._quality_metric(pl)

    def _quality_metric(self, pl: PolicyPlacement) -> None:
        """``kvtier_predictor_auc`` = the policy's own out-of-sample AUC, refreshed after its refits."""
        n = int(getattr(pl.policy, "retrains", 0))
        if n == self._quality_at:
            return
        self._quality_at = n
        q: dict[str, Any] | None = pl.quality()
        if q and q.get("auc") is not None:
            self.metrics.predictor_auc.set(float(q["auc"]))
