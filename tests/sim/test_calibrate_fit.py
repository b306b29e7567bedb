"""bench.calibrate_sim's pure parts: the robust probe fit, the workload as the simulator sees it, and the
prediction through the simulator's public entry point (no live stack: the live comparison is
``python -m bench.calibrate_sim``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.calibrate_sim import (
    compare,
    fit_probe,
    fit_run,
    held_out_ttft,
    layer_at_times,
    lmcache_log_events,
    loop_period,
    loop_schedule,
    loop_times,
    observe_loop_tick,
    predict,
    render,
    request_times,
    run,
    sim_requests,
    theil_sen,
    triggered_loop_times,
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


def test_triggered_loop_runs_are_read_from_lmcaches_own_log(tmp_path: Path) -> None:
    """LMCache's log format (colour codes included); other lines, a below-watermark DEBUG line, a
    truncated line and the L2 loop's run are ignored. Times are local wall time to the ms, relative to the
    given origin."""
    from datetime import datetime

    log = tmp_path / "mp_server.log"
    log.write_text(
        "\x1b[32;20m[2026-12-05 12:27:14,590] LMCache INFO:\x1b[0m L1 memory usage 0.99 above watermark 0.80;"
        " triggering eviction. \x1b[3m(eviction_controller.py:179:lmcache...)\x1b[0m\n"
        "[2026-12-05 12:27:15,592] LMCache DEBUG: L1 memory usage 0.50 below watermark 0.80; skipping"
        " eviction.\n"
        "[2026-12-05 12:27:15,600] LMCache INFO: Stored 8 keys\n"
        "[2026-12-05 12:27:15,610] LMCache INFO: L2 usage 0.95 above watermark 0.80; triggering eviction.\n"
        "\x1b[32;20m[2026-12-05 12:27:15,650] LMCache INFO:\x1b[0m Stored 512 tokens in 0.020 seconds"
        " (engine_driven_transfer.py:301:lmcache.v1.multiprocess.modules.engine_driven_transfer)\n"
        "[2026-12-05 12:27:15,900] LMCache INFO: Retrieved 128 tokens in 0.0005 seconds (engine_driven_tr)\n"
        "\x1b[33;20m[2026-12-05 12:27:16,100] LMCache WARNING:\x1b[0m Failed to batched allocate 14 memory"
        " blocks of size 65536 because no enough memory is available (short by 13 blocks) (memory_manag)\n"
        "\x1b[32;20m[2026-12-05 12:27:16,593] LMCache INFO:\x1b[0m L1 memory usage 1.00 above watermark 0.80;"
        " triggering eviction.\n"
        "[2026-12-05 12:27:17,5",
        encoding="utf-8",
    )
    zero = datetime(2026, 12, 5, 12, 27, 15).timestamp()
    assert triggered_loop_times(log, zero) == pytest.approx([-0.41, 1.593], abs=1e-6)
    ev = lmcache_log_events(log, zero)
    assert ev["stored"] == [pytest.approx([0.63, 0.65], abs=1e-6)]  # [start, end]: end - its duration
    assert ev["retrieved"] == [pytest.approx([0.8995, 0.9], abs=1e-6)]
    assert ev["refused"] == [pytest.approx([1.1], abs=1e-6)]


def test_request_times_come_from_lmcaches_transfers_else_from_the_client() -> None:
    """Requests sent one at a time own the transfers and refusals logged after their send: a hit's look-up
    is its retrieve's start, a miss's look-up its first store or refusal (it came just before them); the
    store is its last refusal (a refused store is still logged as stored), else its store's end (the pickle
    transfer allocates inside the commit); without a logged transfer (nothing new, nothing found) the
    client's times stay. A failed request (NaN send) owns nothing; a transfer before the first send
    belongs to no request."""
    nan = float("nan")
    sent = [0.0, 1.0, nan, 2.0, 3.0, 4.0]
    first = [0.5, 1.9, nan, 2.6, 3.4, 4.5]
    events = {
        "stored": [
            [-0.5, -0.4],
            [0.2, 0.21],
            [1.3, 1.32],
            [2.35, 2.36],
            [2.4, 2.45],  # 2.4: a second store
            [4.2, 4.26],
        ],  # fmt: skip
        "retrieved": [[1.1, 1.2], [3.05, 3.1]],
        "refused": [[4.1], [4.25]],  # request 5: an L2 load's staging, then its store, refused
    }
    look, store, placed = request_times(sent, first, events)
    assert look[:2] + look[3:] == [0.2, 1.1, 2.35, 3.05, 4.1] and look[2] != look[2]
    assert store[:2] == [0.21, 1.32] and store[3:] == [2.36, 3.4, 4.25] and store[2] != store[2]
    assert placed == 5


def test_loop_runs_between_logged_ones_are_spread_at_the_period() -> None:
    """Only runs that evicted are logged (INFO); the ones between found L1 below its watermark. A gap of
    about k periods holds k - 1 unlogged runs, evenly spread; before the first logged run the loop goes
    back at the period to 0; the period is the median one-period gap: a stalled run (1.3 s) does not
    move it."""
    logged = [-0.4, 2.61, 3.62, 4.92, 5.93, 8.96]
    period = loop_period(logged, 1.05)
    assert period == pytest.approx(1.01)
    times = loop_times(logged, period)
    assert times == pytest.approx(
        [-0.4 + 3.01 / 3, -0.4 + 2 * 3.01 / 3, 2.61, 3.62, 4.92, 5.93, 6.94, 7.95, 8.96]
    )
    assert loop_times([2.5], 1.0) == pytest.approx([0.5, 1.5, 2.5])
    assert loop_times([], 1.0) == []
    assert loop_period([3.0], 1.02) == 1.02  # no gap to measure: the tick counter's estimate


def test_in_run_fit_uses_only_even_requests_that_loaded_nothing() -> None:
    n = 200
    rec = [64 * (1 + i % 15) for i in range(n)]
    loaded = [640 if i % 10 == 4 else 0 for i in range(n)]  # some even requests loaded from LMCache
    ttft = [0.03 + 2e-5 * r for r in rec]
    for i in range(n):
        if i % 2 == 1 or loaded[i]:
            ttft[i] = 5.0  # the odd ones and the loaders must not move the fit
    ttft[0] = float("nan")  # a failed request
    f = fit_run(ttft, rec, loaded)
    assert f is not None and f["c0_s"] == pytest.approx(0.03)
    assert f["prefill_s_per_token"] == pytest.approx(2e-5)
    assert f["fit_requests"] == 100 - 20 - 1
    assert len(f["residuals_s"]) == 79 and max(abs(r) for r in f["residuals_s"]) < 1e-6
    assert fit_run(ttft[:30], rec[:30], loaded[:30]) is None  # 12 usable points: the probe's rates stand
    flat = fit_run([0.05] * n, rec, [0] * n)
    assert flat is not None and flat["prefill_s_per_token"] == 0.0 and flat["c0_s"] == pytest.approx(0.05)
    meas = [1.0, 0.1, 1.0, 0.3, 1.0, float("nan"), 1.0, 0.7, 1.0, 0.9]  # even ones are never scored
    h = held_out_ttft([0.1 * i for i in range(10)], meas)
    assert h["requests"] == 4
    assert h["pred_p50_s"] == pytest.approx(0.5) and h["meas_p50_s"] == pytest.approx(0.5)
    # with the fit's scatter: the predicted distribution is every prediction plus every residual
    h = held_out_ttft([0.1 * i for i in range(10)], meas, [-0.05, 0.0, 0.05, 0.4])
    pooled = sorted(0.1 * i + r for i in (1, 3, 7, 9) for r in (-0.05, 0.0, 0.05, 0.4))
    assert h["pred_p50_s"] == pytest.approx(float(np.quantile(pooled, 0.5)))
    assert h["pred_p90_s"] == pytest.approx(float(np.quantile(pooled, 0.9))) and h["pred_p90_s"] > 0.9


def test_in_run_rates_predict_ttft_when_the_machine_slowed_down_after_the_probe() -> None:
    """A recording whose workload ran 1.6x slower than its probe (the 2-core host's drift under a CI's load):
    the probe's rates miss TTFT p50 by that factor, the in-run fit (even requests) predicts the odd ones'."""
    n = 160
    probe_c0, probe_a = 0.02, 2e-5
    rows = [{"chunks": c, "tokens": 64 * c, "cold_s": probe_c0 + probe_a * 64 * c, "l1_s": probe_c0 + 0.001,
             "l2_s": probe_c0 + 0.002} for c in (1, 2, 4, 8, 15) * 3]  # fmt: skip
    reqs = sim_requests(load_workload("bundled", n))
    sent = [0.2 * i for i in range(n)]
    first = [t + 0.05 for t in sent]
    per = layer_at_times(load_scenario("cpu-tiny"), reqs, sent, first)["per_request"]
    slow = 1.6
    ttft = [slow * (probe_c0 + probe_a * r) + 0.002 * (ld > 0) for r, ld in
            zip(per["recomputed_tokens"], per["loaded_tokens"], strict=True)]  # fmt: skip
    live = {"requests": n, "measured": {"gpu_hit_tokens": 0, "l1_hit_tokens": 0, "l2_hit_tokens": 0,
            "external_hit_tokens": 0, "recomputed_tokens": 1, "ttft_p50_s": float(np.quantile(ttft, 0.5)),
            "ttft_p90_s": float(np.quantile(ttft, 0.9))}, "measured_ttft_s": ttft,
            "measured_sent_at_s": sent, "measured_first_token_at_s": first, "probe": {"rows": rows},
            "loadavg": {"after_workload": [1.0, 1.0, 1.0]}, "cpu_count": 2}  # fmt: skip
    out = run(n, live=live)
    rows_by = {r["figure"]: r for r in out["comparison"]}
    assert out["run_fit"]["c0_s"] == pytest.approx(slow * probe_c0, rel=0.05)
    assert rows_by["TTFT p50 (s)"]["ratio"] == pytest.approx(1.0, abs=0.1)
    assert rows_by["TTFT p50 (s), probe's rates"]["ratio"] == pytest.approx(1 / slow, abs=0.1)
    assert out["ttft_held_out"]["requests"] == n // 2
    assert "in-run fit" in render(out)
    probe_only = run(n, live=live, rates="measured")
    assert probe_only["run_fit"] is None and "TTFT p50 (s), probe's rates" not in {
        r["figure"] for r in probe_only["comparison"]}  # fmt: skip
