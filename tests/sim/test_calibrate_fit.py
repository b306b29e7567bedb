"""bench.calibrate_sim's pure parts: the robust probe fit, the workload as the simulator sees it, and the
prediction through the simulator's public entry point (no live stack: the live comparison is
``python -m bench.calibrate_sim``)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.calibrate_sim import compare, fit_probe, predict, sim_requests, theil_sen, with_rates
from bench.live_ab import load_workload
from kvtier.policies.tiers import Tier
from kvtier.replay.sim.scenario import load_scenario


def _rows(noise: dict[int, float] | None = None) -> list[dict[str, float]]:
    rows = []
    for i, n in enumerate([1, 2, 4, 8, 15] * 3):
        tok = n * 64
        cold = 0.1 + 5e-5 * tok + (noise or {}).get(i, 0.0)
        l1 = 0.1 + 5e-5 + 0.002 + tok * 1024 / 1e8  # c0 + one token + 2 ms + bytes at 100 MB/s
        rows.append({"chunks": n, "tokens": tok, "cold_s": cold, "l1_s": l1, "l2_s": l1 + 0.01})
    return rows


def test_fit_recovers_costs_and_one_outlier_does_not_move_it() -> None:
    for rows in (_rows(), _rows({3: 0.8})):  # a send that waited 0.8 s behind the CI's burners
        f = fit_probe(rows)
        assert f["c0_s"] == pytest.approx(0.1, abs=1e-3)
        assert f["prefill_s_per_token"] == pytest.approx(5e-5, rel=0.02)
        assert f["l1_latency_s"] == pytest.approx(0.002, abs=1e-3)
        assert f["l1_read_bytes_s"] == pytest.approx(1e8, rel=0.05)
        assert f["l2_latency_s"] == pytest.approx(0.01, abs=1e-3) and f["l2_read_bytes_s"] == 1e15  # flat
    flat = [dict(r, cold_s=0.2) for r in _rows()]
    assert fit_probe(flat)["prefill_s_per_token"] == 0.0 and fit_probe(flat)["c0_s"] == pytest.approx(0.2)
    assert theil_sen(np.array([1.0, 2, 3]), np.array([2.0, 4, 6])) == pytest.approx((0.0, 2.0))


def test_prediction_runs_the_simulators_default_arm_on_the_bench_prompts() -> None:
    reqs = sim_requests(load_workload("bundled", 40))
    assert all(r.block_tokens == 64 and r.input_length == 64 * len(r.hash_ids) <= 960 for r in reqs)
    sc = with_rates(load_scenario("cpu-tiny"), fit_probe(_rows()))
    assert sc.compute.step_overhead_s == pytest.approx(0.1, abs=1e-3)
    assert sc.tier(Tier.CPU).load_bandwidth_bytes_s == pytest.approx(1e8, rel=0.05)
    fig = predict(sc, reqs)["figures"]
    total = sum(r.input_length for r in reqs)
    assert fig["gpu"] + fig["external"] + fig["recomputed"] == total
    assert fig["l1_lookup"] + fig["l2_lookup"] >= fig["external"]  # LMCache counts from token 0
    assert fig["ttft_p50_s"] >= 0.1
    rows = {r["figure"]: r for r in compare(fig, {"gpu_hit_tokens": fig["gpu"], "l1_hit_tokens": 0,
            "l2_hit_tokens": fig["l2_lookup"], "external_hit_tokens": fig["external"],
            "recomputed_tokens": fig["recomputed"], "ttft_p50_s": 0.2, "ttft_p90_s": 0.4})}  # fmt: skip
    assert rows["recomputed"]["ratio"] == 1.0
    assert rows["TTFT p50 (s)"]["ratio"] == pytest.approx(fig["ttft_p50_s"] / 0.2)


def test_the_layer_replayed_at_measured_times_loses_l2_hits_at_a_fast_pace() -> None:
    """Replaying the live run's times: a fast pace meets LMCache's full L1 between its 1 s eviction runs,
    refused stores are not written to L2 either, so later look-ups find less in L2 -- the effect that made
    the live L2 counts depend on the machine's speed. A failed request (NaN) keeps the previous time."""
    from bench.calibrate_sim import layer_at_times

    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 400))
    n = len(reqs)

    def at(gap: float) -> dict[str, float]:
        sent = [gap * i for i in range(n)]
        sent[5] = float("nan")
        return layer_at_times(sc, reqs, sent, [t + 0.8 * gap for t in sent])

    slow, fast = at(0.5), at(0.02)
    assert fast["l2_lookup"] < 0.9 * slow["l2_lookup"]
    assert fast["recomputed"] > slow["recomputed"]
    assert slow["gpu"] == fast["gpu"]  # vLLM's own prefix cache does not depend on the clock
    assert sum(int(r.input_length) for r in reqs) == slow["gpu"] + slow["external"] + slow["recomputed"]
