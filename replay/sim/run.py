"""One arm of the simulator: a workload through a cache layer and the serving model, with its figures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvtier.policies.base import Request
from kvtier.replay.sim.layer import CacheLayer, ResidencyObserver
from kvtier.replay.sim.scenario import Scenario
from kvtier.replay.sim.serving import ServingModel, ServingResult
from kvtier.replay.sim.stats import summarize


def load_requests(sc: Scenario, *, max_requests: int | None = None, trace: str = "bundled") -> list[Request]:
    """The scenario's slice of the trace: prompts of at least ``min_input_tokens``, the first
    ``max_requests`` of them, arrival times divided by ``time_scale`` (ms)."""
    from kvtier.replay.runner import load_workload

    limit = max_requests if max_requests is not None else sc.max_requests
    reqs = load_workload(trace, block_tokens=sc.block_tokens).requests
    reqs = [r for r in reqs if r.input_length >= sc.min_input_tokens]
    if limit is not None:
        reqs = reqs[:limit]
    if not reqs:
        return []
    t0, s = reqs[0].timestamp_ms, sc.serving.time_scale
    return [replace(r, timestamp_ms=t0 + (r.timestamp_ms - t0) / s) for r in reqs]


def make_layer(sc: Scenario, *, offload: bool, observer: ResidencyObserver | None = None) -> CacheLayer:
    return CacheLayer(sc.tiers, sc.block_bytes, offload=offload, disk_admission=sc.disk_admission,
                      observer=observer, behaviour=sc.layer)  # fmt: skip


def run_arm(
    sc: Scenario,
    reqs: list[Request],
    layer: CacheLayer,
    *,
    on_arrival: Callable[[Request, float], None] | None = None,
    ticker: Callable[[float], None] | None = None,
    batches: int = 10,
) -> tuple[dict[str, Any], ServingResult]:
    model = ServingModel(sc, layer, on_arrival=on_arrival, ticker=ticker)
    res = model.run(reqs)
    return arm_report(layer, res, batches), res


def arm_report(layer: CacheLayer, res: ServingResult, batches: int = 10) -> dict[str, Any]:
    out = summarize(res.records, batches)
    tok = max(1, layer.lookup_tokens)
    out.update(
        requests=len(res.records),
        input_tokens=layer.lookup_tokens,
        output_tokens=sum(r.output_tokens for r in res.records),
        engine_steps=res.steps,
        simulated_s=res.end_s,
        hit_tokens_by_tier={t.value: layer.hit_tokens.get(t.value, 0) for t in layer.order},
        layer_lookup_tokens_by_tier={t.value: layer.layer_lookup_tokens.get(t.value, 0) for t in layer.lower},
        hit_ratio=sum(layer.hit_tokens.values()) / tok,
        bytes_by_link=layer.bytes_by_link(),
        link_busy_s={k: round(v.busy_s, 3) for k, v in sorted(layer.links.items())},
        evictions=dict(layer.evictions),
        ttft_mean_s=sum(r.ttft_s for r in res.records) / max(1, len(res.records)),
        queue_mean_s=sum(r.queue_s for r in res.records) / max(1, len(res.records)),
        load_mean_s=sum(r.load_s for r in res.records) / max(1, len(res.records)),
    )
    return out
