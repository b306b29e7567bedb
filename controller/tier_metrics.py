"""Prometheus families for tiers and the predictor/breaker gauges of the dashboards' contract.

* :class:`PerTierMetrics` — per-tier usage, capacity, hit tokens, lookups and bytes moved per tier link
  (``kvtier_tier_*``, ``kvtier_lookup_tokens_total``); fed by whoever knows the tiers (the demo's emulated
  cache). Every tier and every link starts at zero.
* :class:`PlaneGauges` — ``kvtier_predictor_calibration_error``, ``kvtier_predictor_brier_score`` and
  ``kvtier_actuator_circuit_open{layer}``, refreshed from the control plane's state (``refresh``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtier.policies.tiers import TIER_ORDER

TIER_NAMES: tuple[str, ...] = tuple(t.value for t in TIER_ORDER)


class PerTierMetrics:
    """``kvtier_tier_*`` families on an injected registry (bytes, tokens)."""

    def __init__(self, registry: CollectorRegistry, tiers: Iterable[str] = TIER_NAMES) -> None:
        r = registry
        self.tiers = tuple(tiers)
        self.used = Gauge("kvtier_tier_used_bytes", "Bytes resident in the tier.", ["tier"], registry=r)
        self.capacity = Gauge(
            "kvtier_tier_capacity_bytes", "Capacity of the tier, bytes.", ["tier"], registry=r
        )
        self.hit_tokens = Counter(
            "kvtier_tier_hit_tokens", "Prefix tokens served from the tier.", ["tier"], registry=r
        )
        self.lookup_tokens = Counter("kvtier_lookup_tokens", "Prefix tokens looked up.", registry=r)
        self.moved = Counter(
            "kvtier_tier_moved_bytes", "Bytes moved per tier link.", ["src_tier", "dst_tier"], registry=r
        )
        for t in self.tiers:
            self.used.labels(tier=t).set(0)
            self.capacity.labels(tier=t).set(0)
            self.hit_tokens.labels(tier=t)
            for d in self.tiers:
                if d != t:
                    self.moved.labels(src_tier=t, dst_tier=d)

    def add_moved(self, links: Mapping[str, int]) -> None:
        """Add ``{'src->dst': bytes}`` deltas."""
        for link, n in links.items():
            if n > 0:
                src, _, dst = link.partition("->")
                self.moved.labels(src_tier=src, dst_tier=dst).inc(n)


class PlaneGauges:
    """Predictor calibration/Brier and per-actuator breaker gauges, set by :meth:`refresh`."""

    def __init__(self, registry: CollectorRegistry, layers: Iterable[str] = ()) -> None:
        r = registry
        self.calibration = Gauge(
            "kvtier_predictor_calibration_error",
            "Expected calibration error of P(reuse), 0..1 (10 bins; 0 until trained).",
            registry=r,
        )
        self.brier = Gauge("kvtier_predictor_brier_score", "Brier score of P(reuse), 0..1.", registry=r)
        self.circuit = Gauge(
            "kvtier_actuator_circuit_open", "1 while the adapter's breaker is open.", ["layer"], registry=r
        )
        for name in layers:
            self.circuit.labels(layer=name).set(0)

    def refresh(self, model_info: Mapping[str, Any], actuators: Iterable[Mapping[str, Any]]) -> None:
        """``model_info`` = ``ModelManager.info()``; ``actuators`` = the loop status' actuator entries."""
        if model_info.get("brier") is not None:
            self.brier.set(float(model_info["brier"]))
        ece = expected_calibration_error(model_info.get("calibration") or [])
        if ece is not None:
            self.calibration.set(ece)
        for a in actuators:
            if "name" in a:
                self.circuit.labels(layer=str(a["name"])).set(1.0 if a.get("breaker") == "open" else 0.0)


def expected_calibration_error(bins: Iterable[Any]) -> float | None:
    """ECE from reliability bins (``policies.predictor.reliability`` dicts); None if empty."""
    tot = 0.0
    acc = 0.0
    for b in bins:
        if not isinstance(b, Mapping):
            continue
        n = float(b.get("count", 0) or 0)
        p = b.get("mean_pred")
        y = b.get("observed")
        if n <= 0 or p is None or y is None:
            continue
        tot += n
        acc += n * abs(float(p) - float(y))
    return acc / tot if tot else None
