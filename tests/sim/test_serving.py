"""The discrete-event serving model on hand-computable cases: TTFT = queue wait + load + prefill, chunked
prefill under a per-step token budget, the concurrency limit, position-dependent recompute cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.policies.base import Request
from kvtier.policies.tiers import Tier, TierSpec
from kvtier.replay.sim.layer import CacheLayer
from kvtier.replay.sim.scenario import ComputeModel, Scenario, Serving
from kvtier.replay.sim.serving import ServingModel
from kvtier.replay.sim.stats import ci, paired_diff, summarize


def _sc(concurrency: int = 1, budget: int = 100, b: float = 0.0) -> Scenario:
    cm = ComputeModel("toy", 10, prefill_a_s=1e-3, prefill_b_s=b, weight_bytes=0.0, mem_bytes_s=1e12,
                      step_overhead_s=0.0)  # fmt: skip
    tiers = (TierSpec(Tier.GPU, 100, load_bandwidth_bytes_s=1e15),
             TierSpec(Tier.CPU, 100, load_bandwidth_bytes_s=1e4),
             TierSpec(Tier.DISK, 100, load_bandwidth_bytes_s=1e3))  # fmt: skip
    return Scenario("toy", cm, 10, tiers, Serving(concurrency, budget, 1.0))


def _req(t_s: float, blocks: list[int], out: int = 1) -> Request:
    return Request(t_s * 1e3, 10 * len(blocks), out, np.asarray(blocks, np.int64), 10)


def _run(sc: Scenario, reqs: list[Request], offload: bool = True) -> list[float]:
    layer = CacheLayer(sc.tiers, sc.block_bytes, offload=offload)
    res = ServingModel(sc, layer).run(reqs)
    return [r.ttft_s for r in res.records]


def test_chunked_prefill_and_the_concurrency_queue() -> None:
    sc = _sc()
    a = _req(0.0, list(range(25)))  # 250 tokens: steps of 100, 100, 50 tokens at 1 ms each
    b = _req(0.1, list(range(100, 110)))  # waits for a's slot (freed at 0.25 s), then 100 tokens
    assert _run(sc, [a, b]) == pytest.approx([0.25, 0.15 + 0.1])
    # two slots: b joins at 0.1 s; the third step packs a's last 50 tokens with b's first 50 (100 ms),
    # so a's first token comes at 0.3 s and b's after one more 50-token step (0.35 s)
    assert _run(_sc(concurrency=2), [a, b]) == pytest.approx([0.30, 0.25])


def test_decode_steps_hold_the_slot() -> None:
    sc = _sc()
    a = _req(0.0, [1], out=4)  # 10 tokens prefill (10 ms), then 3 decode steps of 1 token (1 ms each)
    b = _req(0.0, [2])
    assert _run(sc, [a, b]) == pytest.approx([0.010, 0.013 + 0.010])


def test_load_is_part_of_ttft_and_hits_are_not_recomputed() -> None:
    sc = _sc()
    first = _req(0.0, [1, 2, 3])
    again = _req(10.0, [1, 2, 3, 4])
    t = _run(sc, [first, again])
    # again: 3 blocks in HBM (no load) and 1 new block; the last token of a full hit is always computed
    assert t == pytest.approx([0.030, 0.010])
    # HBM too small to keep them: the hits come from L1 over the cpu->gpu link (100 B per 10 ms)
    small = Scenario(
        "toy",
        sc.compute,
        10,
        (TierSpec(Tier.GPU, 0, load_bandwidth_bytes_s=1e15),) + sc.tiers[1:],
        sc.serving,
    )
    t = _run(small, [first, again])
    assert t[1] == pytest.approx(3 * 100 / 1e4 + 0.010)


def test_recompute_cost_grows_with_position() -> None:
    cm = _sc(b=1e-6).compute
    assert cm.prefill_s(0, 3) == pytest.approx(3e-3 + 1e-6 * 3)
    assert cm.prefill_s(1000, 1) - cm.prefill_s(0, 1) == pytest.approx(1e-6 * 1000)
    long_late = _run(_sc(budget=10_000, b=1e-6), [_req(0.0, list(range(100)))])[0]
    assert long_late == pytest.approx(1e-3 * 1000 + 1e-6 * 1000 * 999 / 2)


def test_confidence_intervals_by_batch_means() -> None:
    m, hw = ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hw == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)  # t(0.975, 2) = 4.303
    sc = _sc(concurrency=4)
    reqs = [_req(0.5 * i, [i % 7, 100 + i]) for i in range(60)]
    layer = CacheLayer(sc.tiers, sc.block_bytes)
    recs = ServingModel(sc, layer).run(reqs).records
    s = summarize(recs, batches=6)
    assert s["batches"] == 6 and s["ttft_p50_s_ci95"] >= 0 and s["throughput_tokens_per_s"] > 0
    d = paired_diff(s, s)
    assert d["ttft_p50_s"]["mean"] == 0.0


def test_batch_mean_interval_is_students_t_at_any_batch_count() -> None:
    """The half-width is t(0.975, k-1) * sd / sqrt(k) for any k, not only tabulated degrees of freedom:
    checked against scipy's own t interval on a fixed sample (k = 17 has no entry in a short t table)."""
    from scipy import stats

    rng = np.random.default_rng(7)
    for k in (2, 10, 17, 40):
        x = rng.normal(3.0, 0.5, size=k)
        mean, hw = ci(x.tolist())
        lo, hi = stats.t.interval(0.95, k - 1, loc=x.mean(), scale=stats.sem(x))
        assert mean == pytest.approx(x.mean()) and hw == pytest.approx((hi - lo) / 2, rel=1e-9)
    assert ci([1.0])[1] == math.inf
