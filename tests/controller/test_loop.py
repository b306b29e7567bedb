"""Reconcile loop: level-based idempotency, fallbacks under injected failures, modes, metrics, spans.

Uses the real block index, planner, metrics registry and OTel SDK (in-memory exporter). The actuator here is
an in-process recorder so failures can be injected deterministically; the real-vLLM path is in
test_vllm_warmup_e2e.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvtier.controller.actuators.base import (
    ActuationResult,
    Actuator,
    BlockRef,
    Capability,
    KeyOutcome,
    Outcome,
)
from kvtier.controller.loop import ReconcileLoop
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.pins import Pin, PinSet
from kvtier.controller.policy_doc import Mode, PolicyDoc
from kvtier.controller.reconcile.predict import admits_possible
from kvtier.controller.tracing import make_tracer, make_tracer_provider
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier, TierSpec


class Recorder(Actuator):
    name = "recorder"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, list[str], str]] = []
        self.fail = fail

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.DEMOTE, Capability.PREFETCH})

    def record(self, action: str, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        self.calls.append((action, [b.layer_key for b in blocks], to.value))
        if self.fail:
            raise ConnectionError("layer down")
        return ActuationResult(self.name, action, [KeyOutcome(b.layer_key, Outcome.APPLIED) for b in blocks])

    def demote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self.record("demote", blocks, to)

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self.record("prefetch", blocks, to)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(mode: Mode = "active", fail: bool = False):  # type: ignore[no-untyped-def]
    reg = CollectorRegistry()
    exporter = InMemorySpanExporter()
    tracer = make_tracer(make_tracer_provider(exporter=exporter, simple=True))
    clock = Clock()
    idx = BlockIndex()
    doc = PolicyDoc(
        mode=mode,
        tiers=[
            TierSpec(tier=Tier.GPU, capacity_blocks=4, high_watermark=0.75, low_watermark=0.5),
            TierSpec(tier=Tier.CPU, capacity_blocks=100),
        ],
    )
    act = Recorder(fail)
    loop = ReconcileLoop(
        idx,
        policy=doc,
        actuators=[act],
        metrics=ControllerMetrics(reg),
        tracer=tracer,
        clock=clock,
        model="tiny",
    )
    return loop, idx, act, reg, exporter, clock


def fill_gpu(idx: BlockIndex, clock: Clock) -> None:
    # 4 gpu blocks (over the 3-block high watermark), accessed at different times
    for i, h in enumerate([11, 12, 13, 14]):
        idx.store(h, None, Tier.GPU, t=(clock.t - 100 + i) * 1000)


def test_acts_on_difference_then_repeated_tick_is_noop() -> None:
    loop, idx, act, reg, _, clock = make()
    fill_gpu(idx, clock)
    r1 = loop.tick()
    assert r1.outcome == "ok" and r1.decisions == 2  # shed 4 -> 2 (low watermark)
    assert [c[0] for c in act.calls] == ["demote"] and len(act.calls[0][1]) == 2
    clock.t += 1
    r2 = loop.tick()  # nothing observed changed yet: the in-flight moves are assumed done
    assert r2.decisions == 0 and len(act.calls) == 1
    # the layer did it: observed state now matches desired -> still nothing to do
    for key in act.calls[0][1]:
        h = int(key, 16)
        idx.remove(h, Tier.GPU)
        idx.store(h, None, Tier.CPU, t=clock.t * 1000)
    clock.t += 100
    assert loop.tick().decisions == 0
    assert (
        reg.get_sample_value(
            "kvtier_actuations_total", {"layer": "recorder", "action": "demote", "outcome": "applied"}
        )
        == 2
    )
    assert reg.get_sample_value("kvtier_decisions_total", {"action": "demote", "tier": "cpu"}) == 2


def test_shadow_mode_records_without_acting_and_off_does_nothing() -> None:
    loop, idx, act, reg, _, clock = make(mode="shadow")
    fill_gpu(idx, clock)
    rep = loop.tick()
    assert rep.outcomes["shadow"] == 2 and act.calls == []
    assert {d.outcome for d in loop.decisions.query()} == {"shadow"}
    loop2, idx2, act2, _, _, clock2 = make(mode="off")
    fill_gpu(idx2, clock2)
    assert loop2.tick().decisions == 0 and act2.calls == []


def test_a_loop_that_does_not_plan_observes_only_and_ignores_wakes() -> None:
    """``plans=False`` (another decider owns the layer): in shadow and active alike the tick scores but
    records no decision and calls no actuator, and KV-event wakes do not shorten its interval."""
    import asyncio

    for mode in ("shadow", "active"):
        loop, idx, act, _, _, clock = make(mode=mode)
        loop.plans = False
        fill_gpu(idx, clock)
        rep = loop.tick()
        assert rep.outcome == "ok" and rep.decisions == 0 and act.calls == []
        assert loop.decisions.query() == [] and loop.status()["plans"] is False
    loop._wake = woken = asyncio.Event()  # noqa: SLF001 -- the event ``run`` waits on between ticks
    loop.wake()
    assert not woken.is_set()
    loop.plans = True
    loop.wake()
    assert woken.is_set()


def test_predictor_failure_falls_back_to_heuristic_and_counts() -> None:
    loop, idx, act, reg, _, clock = make()
    fill_gpu(idx, clock)
    loop.fault["predict"] = RuntimeError("model exploded")

    class Broken:
        name = "learned"

        def predict(self, *a: object) -> object:
            raise RuntimeError("model exploded")

        def info(self) -> dict[str, object]:
            return {}

    loop.predictor = Broken()
    loop.fault.clear()
    rep = loop.tick()
    assert rep.outcome == "ok" and rep.predictor == "heuristic" and rep.decisions == 2
    assert (
        reg.get_sample_value("kvtier_loop_fallbacks_total", {"stage": "predict", "fallback": "heuristic"})
        == 1
    )


def test_predictor_run_ahead_on_a_worker_gives_the_same_ticks_and_its_failure_falls_back() -> None:
    """The heuristic predictor (index-only) runs on a worker thread during observe when the index has
    enough rows; forced on here (threshold 0): same decisions as the inline call, and a predictor that
    raises on the worker falls back exactly as an inline failure does."""
    runs = {}
    for ahead in (False, True):
        loop, idx, act, reg, _, clock = make(mode="shadow")
        loop.predict_ahead_min_rows = 0 if ahead else 1 << 62
        fill_gpu(idx, clock)
        reps = []
        for _ in range(3):
            reps.append(loop.tick())
            clock.t += 1
        assert (loop.stages.predict.pool is not None) == ahead
        runs[ahead] = (
            [(r.decisions, r.predictor) for r in reps],
            [(d.action, d.block, d.tier, d.p_reuse) for d in loop.decisions.query()],
        )
    assert runs[True] == runs[False] and runs[True][0][0][0] == 2

    threads: list[str] = []

    class BrokenIndexOnly:
        name = "learned"
        reads_index_only = True

        def predict(self, *a: object) -> object:
            threads.append(threading.current_thread().name)
            raise RuntimeError("model exploded")

        def info(self) -> dict[str, object]:
            return {}

    loop, idx, act, reg, _, clock = make()
    loop.predict_ahead_min_rows = 0
    fill_gpu(idx, clock)
    loop.predictor = BrokenIndexOnly()
    rep = loop.tick()
    assert threads and threads[0].startswith("kvtier-predict")
    assert rep.outcome == "ok" and rep.predictor == "heuristic" and rep.decisions == 2
    assert (
        reg.get_sample_value("kvtier_loop_fallbacks_total", {"stage": "predict", "fallback": "heuristic"})
        == 1
    )
    # observe fails: the worker is cancelled or its error collected (not raised, not counted as predict)
    loop.fault["observe"] = RuntimeError("collector down")
    rep = loop.tick()
    assert rep.decisions == 0 and len(threads) in (1, 2)
    assert [f.split(":")[0] for f in rep.fallbacks] == ["observe->no_action"]
    assert (
        reg.get_sample_value("kvtier_loop_fallbacks_total", {"stage": "predict", "fallback": "heuristic"})
        == 1
    )


@pytest.mark.parametrize("fault", ["observe", "predict", "plan"])
def test_the_predict_ahead_worker_has_finished_when_the_tick_releases_the_index_lock(fault: str) -> None:
    """The worker reads the index without its lock (the tick thread holds it): whatever path the tick
    takes -- a stage failing before or after the worker's result is due -- the worker has returned before
    the tick gives the lock back to the ingest path."""
    state: dict[str, bool] = {}

    class SlowIndexOnly:
        name = "slow"
        reads_index_only = True

        def predict(self, index: BlockIndex, n: int, now_ms: float) -> object:
            state["started"] = True
            threading.Event().wait(0.3)  # a slow predictor (not a synchronisation: nothing sets it)
            state["done"] = True
            return np.zeros(n, np.float32)

        def info(self) -> dict[str, object]:
            return {}

    loop, idx, act, reg, _, clock = make()
    loop.predict_ahead_min_rows = 0
    loop.predictor = SlowIndexOnly()
    fill_gpu(idx, clock)
    loop.fault[fault] = RuntimeError("injected")
    rep = loop.tick()
    # an injected predict fault comes before the worker's result is taken: the heuristic answers
    assert rep.outcome == "ok" and rep.decisions == (2 if fault == "predict" else 0)
    assert state.get("started") and state.get("done")
    assert idx.lock.acquire(blocking=False)  # released after the worker returned
    idx.lock.release()


@pytest.mark.parametrize("stage", ["observe", "plan"])
def test_failing_stage_means_no_action_and_loop_survives(stage: str) -> None:
    loop, idx, act, reg, _, clock = make()
    fill_gpu(idx, clock)
    loop.fault[stage] = RuntimeError("collector down")
    rep = loop.tick()
    assert rep.outcome == "ok" and rep.decisions == 0 and act.calls == []
    assert reg.get_sample_value("kvtier_loop_fallbacks_total", {"stage": stage, "fallback": "no_action"}) == 1
    loop.fault.clear()
    assert loop.tick().decisions == 2  # recovers on the next tick


def test_actuator_exception_becomes_failed_outcomes() -> None:
    loop, idx, act, reg, _, clock = make(fail=True)
    fill_gpu(idx, clock)
    rep = loop.tick()
    assert rep.outcomes["failed"] == 2
    assert all(d.outcome == "failed" and "layer down" in d.detail for d in loop.decisions.query())
    assert (
        reg.get_sample_value(
            "kvtier_actuations_total", {"layer": "recorder", "action": "demote", "outcome": "failed"}
        )
        == 2
    )


def test_unsupported_action_recorded_as_shadow_in_active_mode() -> None:
    loop, idx, act, reg, _, clock = make()
    idx.store(21, None, Tier.CPU, t=clock.t * 1000)
    loop.pins.add(Pin("p1", Tier.CPU, [21], clock.t))  # resident, not acknowledged -> "pin": unsupported
    rep = loop.tick()
    d = loop.decisions.query(action="pin")[0]
    assert d.outcome == "shadow" and d.detail == "no actuator supports it" and rep.outcomes["shadow"] >= 1


def test_spans_per_tick_phase_and_actuation() -> None:
    loop, idx, act, reg, exporter, clock = make()
    fill_gpu(idx, clock)
    loop.tick()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for name in (
        "kvtier.tick",
        "kvtier.observe",
        "kvtier.predict",
        "kvtier.plan",
        "kvtier.act",
        "kvtier.score",
        "kvtier.actuate",
    ):
        assert name in spans, name
    tick = spans["kvtier.tick"]
    assert (
        spans["kvtier.plan"].parent is not None
        and spans["kvtier.plan"].parent.span_id == tick.context.span_id
    )
    a = spans["kvtier.actuate"]
    assert a.attributes is not None and a.attributes["kvtier.layer"] == "recorder"
    assert a.attributes["kvtier.outcome.applied"] == 2


def test_metrics_series_exist_at_zero_on_start() -> None:
    reg = CollectorRegistry()
    ControllerMetrics(reg, layers=["vllm-warmup"])
    assert reg.get_sample_value("kvtier_decisions_total", {"action": "admit", "tier": "remote"}) == 0
    assert (
        reg.get_sample_value(
            "kvtier_actuations_total", {"layer": "vllm-warmup", "action": "prefetch", "outcome": "failed"}
        )
        == 0
    )
    assert reg.get_sample_value("kvtier_shadow_hits_total", {"action": "admit", "tier": "remote"}) == 0
    assert reg.get_sample_value("kvtier_shadow_scored_total", {"action": "demote", "tier": "cpu"}) == 0
    assert reg.get_sample_value("kvtier_loop_tick_seconds_count") == 0


def test_pins_and_shadow_scoring() -> None:
    loop, idx, act, reg, _, clock = make(mode="shadow")
    fill_gpu(idx, clock)
    loop.tick()
    ds = loop.decisions.query()
    assert ds and all(d.score is None for d in ds)
    back = ds[0].block
    clock.t += 10
    idx.touch(back, clock.t * 1000)  # one demoted block comes back -> a regret
    clock.t += loop.policy.shadow_horizon_s + 1
    loop.tick()
    rep = loop.decisions.report
    assert rep.scored == 2 and rep.regrets == 1 and rep.downward == 2
    assert reg.get_sample_value("kvtier_shadow_regrets_total") == 1
    # scored per (action, destination tier) of the decisions, as the per-action dashboard panel reads them
    labels = {(d.action, d.tier or "none") for d in loop.decisions.query() if d.score is not None}
    scored = sum(
        reg.get_sample_value("kvtier_shadow_scored_total", {"action": a, "tier": t}) or 0 for a, t in labels
    )
    assert scored == 2


def test_a_pin_of_blocks_the_index_has_not_seen_is_decided_on_an_empty_index() -> None:
    """A pinned prompt's blocks that vLLM has not stored yet (nothing in the index: an empty view) are
    admitted; their decisions carry freq0 -1 and P(reuse) 1.0 (regression: the per-move gathers ran on
    the empty view and failed the tick)."""
    loop, idx, act, reg, _, clock = make(mode="shadow")
    loop.pins.add(
        Pin(
            id="p1",
            tier=Tier.GPU,
            blocks=[101, 102],
            created_at_s=clock.t,
            token_ids=list(range(32)),
            block_size=16,
        )
    )
    rep = loop.tick()
    assert rep.outcome == "ok" and rep.decisions == 2, rep.fallbacks
    ds = loop.decisions.query()
    assert {d.block for d in ds} == {101, 102}
    assert all(d.freq0 == -1 and d.p_reuse == 1.0 and d.outcome == "shadow" for d in ds)


def test_pinset_block_map_prefers_fastest_tier() -> None:
    ps = PinSet()
    ps.add(Pin("a", Tier.CPU, [1, 2], 0.0))
    ps.add(Pin("b", Tier.GPU, [2], 0.0, ttl_s=10))
    assert ps.block_map(5.0) == {1: Tier.CPU, 2: Tier.GPU}
    assert ps.block_map(11.0) == {1: Tier.CPU, 2: Tier.CPU}


def test_run_counts_tick_timeouts_and_skips_overlapping_ticks() -> None:
    """A stuck actuation makes a tick exceed tick_timeout_s: counted; the runner goes on, skips overlaps."""
    import asyncio
    import threading
    import time as _time

    loop, idx, act, reg, _, clock = make()
    fill_gpu(idx, clock)
    release = threading.Event()
    orig = act.record

    def stuck(action: str, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        release.wait(timeout=30)
        return orig(action, blocks, to)

    act.record = stuck
    loop.set_policy(loop.policy.model_copy(update={"tick_timeout_s": 0.2, "tick_interval_s": 0.05}))

    def sample(outcome: str) -> float:
        return reg.get_sample_value("kvtier_loop_ticks_total", {"outcome": outcome}) or 0.0

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop, min_interval_s=0.01))
        deadline = _time.monotonic() + 20
        while (sample("timeout") < 1 or sample("overlap") < 1) and _time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # polling a condition with a deadline
        release.set()
        while sample("ok") < 1 and _time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, timeout=10)

    asyncio.run(main())
    assert sample("timeout") >= 1 and sample("overlap") >= 1 and sample("ok") >= 1
    assert loop.errors["timeout"] >= 1


def test_json_log_lines() -> None:
    import json
    import logging

    from kvtier.controller.logs import JsonFormatter

    rec = logging.makeLogRecord(
        {
            "name": "kvtier.controller.loop",
            "levelno": 30,
            "levelname": "WARNING",
            "msg": "tick %d failed",
            "args": (3,),
            "tick": 3,
        }
    )
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "tick 3 failed" and out["level"] == "warning" and out["tick"] == 3


def test_outcomes_keyed_by_layer_keys_are_attributed_per_ref_and_routing_respects_tiers() -> None:
    """A layer that answers per chunk (like LMCache) still yields one outcome per decision; gpu-only moves are
    not routed to a cpu/disk layer, and admits only to an adapter that can re-create blocks."""

    class Chunky(Recorder):
        name = "lmcache-mp"
        tiers = frozenset({Tier.CPU, Tier.DISK})

        def record(self, action: str, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
            self.calls.append((action, [b.layer_key for b in blocks], to.value))
            out = [KeyOutcome(f"{b.layer_key}@chunk{i}", Outcome.APPLIED) for b in blocks for i in range(2)]
            return ActuationResult(self.name, action, out)

    loop, idx, _, reg, _, clock = make()
    layer = Chunky()
    loop.actuators = [layer]
    fill_gpu(idx, clock)  # gpu over its watermark -> demote gpu->cpu: gpu is not a tier of this layer
    rep = loop.tick()
    assert rep.outcomes["shadow"] == 2 and layer.calls == []
    loop, idx, _, reg, _, clock = make()
    loop.set_policy(
        loop.policy.model_copy(
            update={
                "tiers": [
                    TierSpec(tier=Tier.CPU, capacity_blocks=4, high_watermark=0.75, low_watermark=0.5),
                    TierSpec(tier=Tier.DISK, capacity_blocks=100),
                ]
            }
        )
    )
    loop.actuators = [layer]
    for i, h in enumerate([11, 12, 13, 14]):  # cpu over its watermark -> demote cpu->disk: both the layer's
        idx.store(h, None, Tier.CPU, t=(clock.t - 100 + i) * 1000)
    rep = loop.tick()
    assert rep.outcomes["applied"] == 2 and len(layer.calls) == 3  # one batch call, then one per ref
    assert all(d.outcome == "applied" and "chunk" in d.detail for d in loop.decisions.query())
    # the loop remembers what it moved inside the layer (the index cannot see LMCache's tiers)
    moved = {d.block for d in loop.decisions.query()}
    assert {b: bits for b, (_, bits) in loop.layer_residency.items()} == dict.fromkeys(moved, 4)  # disk
    loop2, idx2, _, _, _, clock2 = make()
    loop2.actuators = [Chunky()]
    idx2.store(31, None, Tier.CPU, t=clock2.t * 1000)
    loop2.pins.add(Pin("g", Tier.GPU, [31, 32], clock2.t, token_ids=list(range(64)), block_size=32))
    rep2 = loop2.tick()  # prefetch cpu->gpu and admit of 32: neither can go to a cpu/disk layer
    assert rep2.outcomes["shadow"] == 2 and loop2.actuators[0].calls == []


def test_emulated_layer_pins_are_refreshed_each_active_tick_and_unpinned_when_the_pin_goes() -> None:
    """A layer with ``refresh_pins()`` (LMCache MP's emulated pins) gets it once per active tick; deleting the
    pin makes the loop ``unpin`` it at the layer (else the layer would keep re-loading it forever)."""

    class PinLayer(Recorder):
        name = "lmcache-mp"
        token_addressed = True  # the loop calls it ref by ref
        refreshes_pins = True

        def __init__(self) -> None:
            super().__init__()
            self.held: dict[tuple[int, ...], BlockRef] = {}
            self.refreshes = 0

        def capabilities(self) -> frozenset[Capability]:
            return frozenset({Capability.PIN, Capability.UNPIN})

        def pin(self, blocks: Sequence[BlockRef], tier: Tier, ttl_s: float | None = None) -> ActuationResult:
            self.calls.append(("pin", [b.layer_key for b in blocks], tier.value))
            for b in blocks:
                self.held[b.token_ids or ()] = b
            out = [KeyOutcome(f"c{len(b.token_ids or ())}", Outcome.APPLIED) for b in blocks]
            return ActuationResult(self.name, "pin", out)

        def unpin(self, blocks: Sequence[BlockRef], tier: Tier) -> ActuationResult:
            self.calls.append(("unpin", [b.layer_key for b in blocks], tier.value))
            gone = [self.held.pop(b.token_ids or (), None) for b in blocks]
            return ActuationResult(self.name, "unpin", [KeyOutcome("k", Outcome.APPLIED) for g in gone if g])

        def refresh_pins(self) -> ActuationResult:
            self.refreshes += 1
            out = [KeyOutcome("c", Outcome.APPLIED) for _ in self.held]
            return ActuationResult(self.name, "pin_refresh", out)

    loop, idx, _, reg, _, clock = make()
    layer = PinLayer()
    loop.actuators = [layer]
    for h in (41, 42):
        idx.store(h, None, Tier.GPU, t=clock.t * 1000)
    loop.pins.add(Pin("p", Tier.CPU, [41, 42], clock.t, token_ids=list(range(64)), block_size=32))
    loop.tick()
    assert [c[0] for c in layer.calls] == ["pin", "pin"] and len(layer.held) == 2 and layer.refreshes == 1
    assert loop.pinned_at_layer == {41, 42} and all(bits == 2 for _, bits in loop.layer_residency.values())
    clock.t += 1
    loop.tick()
    assert len(layer.calls) == 2 and layer.refreshes == 2  # acked: refresh only

    def sample(action: str) -> float:
        labels = {"layer": "lmcache-mp", "action": action, "outcome": "applied"}
        return reg.get_sample_value("kvtier_actuations_total", labels) or 0.0

    assert sample("pin_refresh") == 4.0 and sample("pin") == 2.0
    loop.pins.remove("p")
    clock.t += 1
    loop.tick()
    assert [c[0] for c in layer.calls] == ["pin", "pin", "unpin"] and layer.held == {}
    assert loop.pinned_at_layer == set()
    assert sample("unpin") == 2.0
    loop.set_policy(loop.policy.model_copy(update={"mode": "shadow"}))
    loop.tick()
    assert layer.refreshes == 3  # shadow mode: no refreshes


def test_lmcache_mp_breaker_and_retries_are_configurable() -> None:
    from kvtier.controller.actuators import registry

    act = registry.build("lmcache-mp", url="http://127.0.0.1:9", breaker_reset_s=0.5, breaker_failures=2,
                         retries=1, model_name="/models/tiny")  # fmt: skip
    br = act.caller.resilient.breaker  # type: ignore[attr-defined]
    assert (br.reset_timeout_s, br.failure_threshold) == (0.5, 2)
    assert act.caller.resilient.retry.max_attempts == 1  # type: ignore[attr-defined]
    assert act.model_name == "/models/tiny"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="retries"):
        registry.build("lmcache-mp", url="http://127.0.0.1:9", retries=0)


def test_active_mode_without_a_recreating_actuator_spends_the_budget_on_feasible_moves() -> None:
    """Admissions (gain = the whole prefill) would crowd a disk -> cpu promote (gain = load-time difference)
    out of the ops budget although no configured actuator can admit; in active mode they are not planned."""
    from kvtier.controller.policy_doc import BudgetLimits

    class Layer(Recorder):
        name = "lmcache-mp"
        tiers = frozenset({Tier.CPU, Tier.DISK})

        def capabilities(self) -> frozenset[Capability]:
            return frozenset({Capability.PROMOTE})

        def promote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
            return self.record("promote", blocks, to)

    loop, idx, _, _, _, clock = make()
    layer = Layer()
    loop.actuators = [layer]
    loop.set_policy(loop.policy.model_copy(update={
        "tiers": [TierSpec(tier=Tier.CPU, capacity_blocks=100, load_bandwidth_bytes_s=2e10),
                  TierSpec(tier=Tier.DISK, capacity_blocks=100, load_bandwidth_bytes_s=1e9)],
        "default_budget": BudgetLimits(ops_per_s=2.0, burst_s=1.0)}))  # fmt: skip
    t = clock.t * 1000
    idx.store(51, None, Tier.DISK, t=t)
    gone = list(range(61, 71))
    for h in gone:  # evicted from the GPU, tokens known: admittable by a warm-up, not by this layer
        idx.store(h, None, Tier.GPU, t=t)
        idx.remove(h, Tier.GPU)
    loop.tokens.add_chain(gone, list(range(32 * len(gone))), 32)
    rep = loop.tick()
    assert [(c[0], c[1]) for c in layer.calls] == [("promote", [f"{51:016x}"])], layer.calls
    assert rep.outcomes["applied"] == 1 and not [d for d in loop.decisions.query() if d.action == "admit"]
    loop2, idx2, _, _, _, _ = make(mode="shadow")
    idx2.store(61, None, Tier.GPU, t=t)
    idx2.remove(61, Tier.GPU)
    loop2.tokens.add_chain([61], list(range(32)), 32)
    assert admits_possible(loop2.mode, loop2.actuators)  # shadow mode still scores admits
    assert loop2.tick().decisions >= 1


def test_pending_decisions_stay_bounded_and_drops_are_counted() -> None:
    """Decisions made faster than their horizon passes: the oldest unscored ones are dropped and counted
    (report, metric), the newest is the one scored, and the ring keeps every decision queryable."""
    loop, idx, act, reg, _, clock = make(mode="shadow")
    loop.decisions.max_pending = 1
    fill_gpu(idx, clock)
    loop.tick()  # sheds 2 gpu blocks: 2 decisions, 1 kept
    rep = loop.decisions.report
    assert len(loop.decisions) == 2 and rep.unscored_dropped == 1
    assert [d.id for d in loop.decisions.pending()] == [loop.decisions.query(limit=1)[0].id]  # the newest
    clock.t += loop.policy.shadow_horizon_s + 1
    loop.decisions.max_pending = 100  # room for the next tick's decisions: the one kept gets scored
    loop.tick()
    assert rep.scored == 1 and rep.unscored_dropped == 1
    assert reg.get_sample_value("kvtier_shadow_unscored_dropped_total") == rep.unscored_dropped


def test_decision_log_bound_direct() -> None:
    from kvtier.controller.decisions import Decision, DecisionLog

    with pytest.raises(ValueError, match="max_pending"):
        DecisionLog(max_pending=0)
    log_ = DecisionLog(max_len=10, max_pending=4)
    mk = lambda i: Decision(i, 0, 0.0, "evict", i, "gpu", "gpu", 0.0, 0.5, False, "shadow")  # noqa: E731
    log_.add_many([mk(i) for i in range(1, 4)])
    log_.add(mk(4))
    assert log_.report.unscored_dropped == 0
    log_.add_many([mk(i) for i in range(5, 8)])
    assert [d.id for d in log_.pending()] == [4, 5, 6, 7]
    assert log_.report.unscored_dropped == 3 and len(log_) == 7


class SlowWarmup(Recorder):
    """A re-creating (warm-up-like) adapter whose call takes ``call_s`` seconds of the injected clock."""

    name = "slow-warmup"
    recreates = True

    def __init__(self, clock: Clock, call_s: float) -> None:
        super().__init__()
        self.clock, self.call_s = clock, call_s

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        self.clock.t += self.call_s
        return super().prefetch(blocks, to)


def test_the_pin_retry_window_starts_when_the_actuation_returned() -> None:
    """A warm-up that takes 4 s of a 5 s pin retry window must not be re-sent 2 s after it returned (its KV
    events may still be on their way); an unmet pin is retried once the window has passed since then."""
    loop, idx, _, _, _, clock = make()
    act = SlowWarmup(clock, call_s=4.0)
    loop.actuators = [act]
    assert loop.policy.pin_retry_s == 5.0
    loop.pins.add(
        Pin(
            id="p1",
            tier=Tier.GPU,
            blocks=[101, 102],
            created_at_s=clock.t,
            token_ids=list(range(32)),
            block_size=16,
        )
    )
    t0 = clock.t
    assert loop.tick().decisions == 2 and len(act.calls) == 1 and clock.t == t0 + 4
    clock.t = t0 + 6  # 2 s after the warm-up returned, nothing in the index yet
    assert loop.tick().decisions == 0 and len(act.calls) == 1
    clock.t = t0 + 4 + 5  # the window has passed since the call returned: the unmet pin is retried
    assert loop.tick().decisions == 2 and len(act.calls) == 2


def test_predictor_figures_absent_until_the_first_fit() -> None:
    """No ``kvtier_predictor_auc 0`` before any training: the series appears with its first value."""
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    assert reg.get_sample_value("kvtier_predictor_auc") is None
    assert reg.get_sample_value("kvtier_predictor_training_samples") is None
    m.predictor_auc.set(0.71)
    m.predictor_auc.set(0.73)
    assert reg.get_sample_value("kvtier_predictor_auc") == 0.73
