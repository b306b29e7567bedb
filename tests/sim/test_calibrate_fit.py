"""bench.calibrate_sim's pure parts: the robust probe fit, the workload as the simulator sees it, and the
prediction through the simulator's public entry point (no live stack: the live comparison is
``python -m bench.calibrate_sim``)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.calibrate_sim import (
    compare,
    fit_probe,
    layer_at_times,
    loop_schedule,
    observe_loop_tick,
    predict,
    sim_requests,
    theil_sen,
    with_rates,
)
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


def test_loop_schedule_from_two_ticks_and_bad_ticks_are_an_error() -> None:
    first, period = loop_schedule([(-2.35, 10), (17.85, 30)])  # 20 ticks in 20.2 s
    assert period == pytest.approx(1.01)
    assert first == pytest.approx(-2.35 + 3 * 1.01)  # the first run at or after the workload's start
    with pytest.raises(ValueError, match="advance"):
        loop_schedule([(1.0, 5), (2.0, 5)])


def test_observe_loop_tick_polls_a_real_metrics_endpoint_until_the_counter_moves() -> None:
    """Against a real HTTP server whose loop counter moves on its 4th scrape; the clock is injected."""
    import http.server
    import itertools

    from tests.peers.http_server import serving

    gets: list[int] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            gets.append(1)
            n = 7 + (len(gets) >= 4)
            body = f"lmcache_mp_l1_eviction_loop_ticks_total {n}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    ticks = itertools.count(0.0, 0.5)  # every clock read advances 0.5 s
    with serving(H) as url:
        at, count = observe_loop_tick(url, timeout_s=60, poll_s=0, clock=lambda: next(ticks))
        assert count == 8 and len(gets) == 4
        assert at == pytest.approx(3.0)  # the middle of the reads after scrapes 3 (2.5) and 4 (3.5)
        with pytest.raises(LookupError, match="no nope_total"):
            observe_loop_tick(url, counter="nope_total", clock=lambda: next(ticks))
        with pytest.raises(TimeoutError):
            observe_loop_tick(url, timeout_s=2, poll_s=0, clock=lambda: next(ticks))


def test_layer_replay_follows_the_measured_loop_phase() -> None:
    """The same requests at the same times: where LMCache's eviction loop runs decides which stores a full
    L1 refuses -- the timed replay must take the measured phase, not assume one."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 200))
    sent = [0.05 * i for i in range(len(reqs))]
    first = [s + 0.04 for s in sent]
    by_phase = {ph: layer_at_times(sc, reqs, sent, first, [(ph - 1.0, 3), (ph + 9.0, 13)])
                for ph in (0.05, 0.35, 0.65, 0.95)}  # fmt: skip
    assert len({f["l1_refused"] for f in by_phase.values()}) > 1
    assert all(f["l1_refused"] > 0 for f in by_phase.values())  # 20 requests/s outrun a 1 s loop
