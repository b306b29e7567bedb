"""One policy object for replay and the live loop: the reconcile loop, fed vLLM-shaped KV events of a trace,
makes the same CPU-tier admissions and evictions as ``replay`` of that trace with the same policy and seed.

The KV events are encoded as vLLM 0.33 publishes them (msgpack, map-tagged) and go through the real
decoder, the real ingestor (``KvIngestor`` with the ``ControlSink``) and the real control plane; the engine is
an emulated prefix cache with ``kv_cache_report_mode: full`` (hits re-announced), since a real vLLM cannot
replay a trace's hashes (vLLM itself is covered by test_vllm_warmup_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import BlockStored, decode_frames
from kvtier.controller.plane import ControlPlane
from kvtier.controller.policy_doc import BudgetLimits, PolicyDoc, PredictorSettings
from kvtier.controller.sidecar import Sidecar
from kvtier.policies.base import Request
from kvtier.policies.registry import get_policy
from kvtier.policies.tiers import Tier, TierSpec
from kvtier.replay.engine import replay
from kvtier.replay.synthetic import multiturn_trace
from tests.controller import built

BS = 16  # engine block size, tokens


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def as_events_trace(chains: list[tuple[float, list[int]]]) -> list[Request]:
    """The requests the KV events of ``chains`` describe: whole chain, blocks x block size, output unknown."""
    return [Request(t, len(h) * BS, 0, np.asarray(h, np.int64), block_tokens=BS) for t, h in chains]


def handmade() -> list[tuple[float, list[int]]]:
    """Three sessions sharing a system prompt (blocks 1, 2), multi-turn growth, a repeated document."""
    out: list[tuple[float, list[int]]] = []
    t = 1_000_000.0
    sess = {s: [1, 2] for s in (10, 20, 30)}
    nxt = 100
    for turn in range(6):
        for s in (10, 20, 30):
            grow = [nxt, nxt + 1] if (turn + s) % 3 else [nxt]
            nxt += 2
            sess[s] = sess[s] + grow
            out.append((t, list(sess[s])))
            t += 250.0
        out.append((t, [1, 2, 7, 8, 9]))  # a shared document
        t += 500.0
    return out


def synthetic(n: int) -> list[tuple[float, list[int]]]:
    # times on a 250 ms grid: exact in binary, so seconds (the clock) -> ms is lossless
    # ~0.7 requests/s per session rate: the model fitted at request 1000 gets scored by request 2000
    reqs = multiturn_trace(n, seed=3, sessions_per_s=0.7)
    return [(round(r.timestamp_ms / 250.0) * 250.0, r.hash_ids.tolist()) for r in reqs]


class Engine:
    """Emulated engine prefix cache (unbounded) publishing vLLM KV-event batches (report mode full)."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.seq = 0

    def frames(self, ts: float, chain: list[int]) -> list[bytes]:
        k = 0
        while k < len(chain) and chain[k] in self.cached:
            k += 1
        events = []
        if k:  # hit report: the cached prefix re-announced
            events.append(BlockStored(block_hashes=chain[:k], parent_block_hash=None, block_size=BS))
        if k < len(chain):  # the newly computed blocks
            parent = chain[k - 1] if k else None
            events.append(BlockStored(block_hashes=chain[k:], parent_block_hash=parent, block_size=BS))
        self.cached.update(chain)
        self.seq += 1
        payload = msgspec.msgpack.encode([ts, events, None])
        return [b"kv-events", self.seq.to_bytes(8, "big"), payload]


def replay_decisions(name: str, cap: int, reqs: list[Request], seed: int) -> list[tuple[set[int], set[int]]]:
    """Per request: (blocks that became resident, blocks that left), from ``replay`` of ``reqs``."""
    pol = get_policy(name, cap, seed=seed)
    res: set[int] = set()
    out: list[tuple[set[int], set[int]]] = []

    def on_request(_: object) -> None:
        i = len(out)
        now = {b for b in set(reqs[i].hash_ids.tolist()) | res if pol.contains(b)}
        out.append((now - res, res - now))
        res.clear()
        res.update(now)

    stats = replay(reqs, pol, on_request=on_request)
    assert stats.requests == len(reqs) == len(out)
    return out


def live_plane(
    tmp: Path, name: str, cap: int, seed: int, t0: float
) -> tuple[ControlPlane, KvIngestor, Clock, Sidecar]:
    clock = Clock(t0)
    doc = PolicyDoc(
        mode="shadow",
        tiers=[
            TierSpec(tier=Tier.GPU, capacity_blocks=1_000_000, load_bandwidth_bytes_s=1e12),
            TierSpec(tier=Tier.CPU, capacity_blocks=cap, load_bandwidth_bytes_s=2e10),
        ],
        hysteresis_s=86400,  # shadow mode: moves stay assumed done for the whole run
        default_budget=BudgetLimits(bytes_per_s=1e15, ops_per_s=1e6, burst_s=1.0),
        block_size_tokens=BS,
        predictor=PredictorSettings(seed=seed),
    )
    ing = KvIngestor()
    sc = built.sidecar(tmp, ingestor=ing, clock=clock, doc=doc, policy=name)  # the root adds the ControlSink
    return sc.plane, ing, clock, sc


def live_decisions(
    plane: ControlPlane, ing: KvIngestor, clock: Clock, chains: list[tuple[float, list[int]]]
) -> list[tuple[set[int], set[int]]]:
    """Per request: (CPU admissions, CPU evictions) the loop planned in the tick after its KV events."""
    eng = Engine()
    out: list[tuple[set[int], set[int]]] = []
    loop = plane.loop
    for ts, chain in chains:
        clock.t = ts / 1000.0
        ing.apply("engine", decode_frames(eng.frames(clock.t, chain)))
        ing.flush()  # as the subscriber does after each socket drain
        assert loop.placement is not None and len(loop.placement.requests) == 0  # fed on arrival
        rep = loop.tick()
        assert rep.outcome == "ok" and not rep.fallbacks, rep.to_dict()
        moves = rep.plan.moves if rep.plan else []
        adm = {m.block for m in moves if m.dst is Tier.CPU and m.action in ("admit", "promote")}
        ev = {m.block for m in moves if m.src is Tier.CPU and m.action in ("evict", "demote")}
        assert not [m for m in moves if m.dst is Tier.GPU or m.src is Tier.GPU]  # GPU: never over capacity
        out.append((adm, ev))
    return out


@pytest.mark.parametrize("name", ["lru", "s3fifo", "learned"])
def test_live_loop_matches_replay_on_handmade_trace(tmp_path: Path, name: str) -> None:
    chains = handmade()
    reqs = as_events_trace(chains)
    cap = 9
    want = replay_decisions(name, cap, reqs, seed=7)
    assert sum(len(e) for _, e in want) >= 5  # the trace does evict
    plane, ing, clock, _ = live_plane(tmp_path, name, cap, 7, chains[0][0] / 1000.0)
    got = live_decisions(plane, ing, clock, chains)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g == w, f"request {i}: live (admit, evict) {g} != replay {w}"
    pl = plane.loop.placement
    assert pl is not None and pl.policy.name == name and pl.served == len(reqs)
    assert pl.requests.counts["dropped"] == 0


def test_ingest_feeding_never_waits_for_a_tick_and_the_tick_serves_the_rest(tmp_path: Path) -> None:
    """While a tick holds the policy the ingest path leaves requests queued; the next tick serves them (same
    decisions as feeding them on arrival: the handmade trace, two requests per tick)."""
    chains = handmade()
    want = replay_decisions("lru", 9, as_events_trace(chains), seed=7)
    plane, ing, clock, _ = live_plane(tmp_path, "lru", 9, 7, chains[0][0] / 1000.0)
    pl, eng, loop = plane.loop.placement, Engine(), plane.loop
    assert pl is not None
    adm_all: set[int] = set()
    for i, (ts, chain) in enumerate(chains):
        clock.t = ts / 1000.0
        if i % 2 == 0:
            with pl.lock:  # a tick in progress
                ing.apply("engine", decode_frames(eng.frames(clock.t, chain)))
                ing.flush()
            assert len(pl.requests) == 1 and pl.served == i
            continue
        ing.apply("engine", decode_frames(eng.frames(clock.t, chain)))  # feeds both, in arrival order
        ing.flush()
        assert len(pl.requests) == 0 and pl.served == i + 1
        rep = loop.tick()
        assert rep.outcome == "ok" and rep.plan is not None
        adm_all |= {m.block for m in rep.plan.moves if m.dst is Tier.CPU}
    resident: set[int] = set()
    for a, e in want:
        resident = (resident | a) - e
    assert resident <= adm_all and set(pl.desired_blocks().tolist()) == resident


def test_live_learned_matches_replay_through_retrains_and_reports_quality(tmp_path: Path) -> None:
    chains = synthetic(2050)
    reqs = as_events_trace(chains)
    cap = 400
    want = replay_decisions("learned", cap, reqs, seed=1)
    plane, ing, clock, sc = live_plane(tmp_path, "learned", cap, 1, chains[0][0] / 1000.0)
    got = live_decisions(plane, ing, clock, chains)
    bad = [i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert not bad, f"first mismatch at request {bad[0]}: live {got[bad[0]]} != replay {want[bad[0]]}"
    assert sum(len(e) for _, e in want) > 1000
    # the same object reports its own quality through the API and the metric
    loop = plane.loop
    assert loop.placement is not None
    q = loop.placement.policy.quality()  # type: ignore[attr-defined]
    assert q["trained"] and q["retrains"] >= 1 and q["auc"] is not None
    c = built.client(sc)
    m = c.get("/v1/model").json()
    assert m["predictor"] == "policy:learned" and m["trained"] is True
    for k in ("auc", "auc_first_touch", "auc_retouched", "fallback_auc", "beat_fallback_rate"):
        assert m[k] == q[k], k
    assert m["calibration"] == q["reliability"] and m["policy"]["requests_served"] == len(reqs)
    assert "fallback_model" in m
    assert set(m["auc_of"]) == {"auc", "fallback_auc", "fallback_model.auc"}  # each AUC says what it is of
    metrics = c.get("/metrics/").text
    line = next(x for x in metrics.splitlines() if x.startswith("kvtier_predictor_auc "))
    assert abs(float(line.split()[1]) - q["auc"]) < 1e-9
    # P(reuse) of the planner's moves came from the policy
    assert loop.last is not None and loop.last.predictor.startswith("policy:learned")
    r = c.post("/v1/model/retrain")
    assert r.status_code == 200 and r.json()["retrains"] >= q["retrains"]
