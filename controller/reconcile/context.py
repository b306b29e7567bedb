"""The per-tick context the stages pass along, the tick report, and stage-failure bookkeeping."""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.actuators.base import Actuator
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.predict import ReusePredictor
from kvtier.policies.index import BlockIndex
from kvtier.policies.planner import BlockView, Plan

log = logging.getLogger("kvtier.controller.loop")  # one logger for the whole tick


@dataclass(slots=True)
class TickReport:
    """What one tick did (``/status``'s ``last_tick``); ``at_s`` and ``duration_s`` in seconds."""

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


class StageFailed(Exception):
    """A stage could not produce its output: the tick ends with ``fallback`` (e.g. ``no_action``)."""

    def __init__(self, stage: str, fallback: str, cause: BaseException) -> None:
        super().__init__(f"{stage}->{fallback}: {type(cause).__name__}: {cause}")
        self.stage, self.fallback, self.cause = stage, fallback, cause


class StageFaults:
    """Counts stage fallbacks (metric, error counter, report line, warning) and raises injected faults
    (``injected``: stage -> exception, the loop's ``fault`` test hook)."""

    def __init__(
        self, metrics: ControllerMetrics, errors: Counter[str], injected: dict[str, BaseException]
    ) -> None:
        self.metrics, self.errors, self.injected = metrics, errors, injected

    def inject(self, stage: str) -> None:
        """Raise the exception injected for ``stage``, if any."""
        exc = self.injected.get(stage)
        if exc is not None:
            raise exc

    def fallback(self, rep: TickReport, stage: str, fallback: str, exc: BaseException) -> None:
        """Record that ``stage`` failed with ``exc`` and the tick fell back to ``fallback``."""
        self.metrics.fallbacks.labels(stage=stage, fallback=fallback).inc()
        self.errors[f"{stage}:{type(exc).__name__}"] += 1
        rep.fallbacks.append(f"{stage}->{fallback}: {type(exc).__name__}: {exc}")
        log.warning(
            "tick %d: %s failed (%s: %s); fallback %s", rep.tick, stage, type(exc).__name__, exc, fallback
        )


@dataclass(slots=True)
class TickContext:
    """One tick's inputs (a snapshot of the loop's configuration at its start) and each stage's output.

    Times: ``now`` in seconds (the injected clock); the index keeps milliseconds."""

    now: float
    policy: PolicyDoc
    rep: TickReport
    index: BlockIndex
    faults: StageFaults
    actuators: list[Actuator]
    predictor: ReusePredictor
    fallback_predictor: ReusePredictor
    placement: PolicyPlacement | None  # the placement policy when its tier is managed, else None
    n: int = 0  # index rows observed
    ahead: Future[Any] | None = None  # the predictor running on the worker thread (predict stage)
    view: BlockView | None = None  # observe: placeholder P(reuse); predict: the real one
    desired: npt.NDArray[np.bool_] | None = None  # overlay: the policy's resident set, per row
    policy_rows: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    policy_q: npt.NDArray[np.floating[Any]] | None = None  # the policy's P(reuse) for policy_rows
    policy_exc: BaseException | None = None  # why the policy could not score (a predict fallback)
    p: npt.NDArray[np.float32] | None = None  # predict: P(reuse) per row
    p_owned: bool = False  # may the tick overwrite ``p`` in place (a fresh array)?
    plan: Plan | None = None

    def fallback(self, stage: str, fallback: str, exc: BaseException) -> None:
        """A degraded but continuing stage (counted like a failure)."""
        self.faults.fallback(self.rep, stage, fallback, exc)

    def require_view(self) -> BlockView:
        """The observed view (a stage after observe; observe failing ends the tick before them)."""
        if self.view is None:
            raise RuntimeError("no view: the observe stage did not run")
        return self.view
