"""The L1 keeper behind its latency guard: vLLM's TTFT read over real HTTP, a trip to shadow when acting costs
latency, no drops while held, the guard's families and status.

The engine here is a real HTTP server serving vLLM-format ``/metrics`` text whose TTFT histogram the test
advances period by period (slower in periods where the keeper acts): a real vLLM's TTFT on this machine
does not depend on the keeper in a controllable way, and the guard's subject is its decision, not vLLM.
The LMCache side is the same server's text (an L1-hit counter); no drop reaches a layer in this test.
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.controller.l1_keeper import EngineTtftReader, L1Keeper, engine_ttft
from tests.peers.http_server import MetricsText, metrics_text_handler, serving

VLLM_TEXT = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.41
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 4.0 1733400000000
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.2 1733400000000
vllm:time_to_first_token_seconds_created{engine="0",model_name="tiny"} 1.7e9
vllm:time_to_first_tokens_seconds_sum 99.0
"""


def test_engine_ttft_sums_every_engine_and_ignores_other_series() -> None:
    assert engine_ttft(VLLM_TEXT) == (0.41 + 0.2, 14.0)
    assert engine_ttft("vllm:num_requests_running 1.0\n") is None
    assert engine_ttft('vllm:time_to_first_token_seconds_sum{a="b"} nan-ish\n') is None


def _text(ttft_sum: float, count: float, l1_tokens: float) -> str:
    return (
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="tiny"}} {count}\n'
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="tiny"}} {ttft_sum}\n'
        f"lmcache_mp_lookup_hit_l1_tokens_total {l1_tokens}\n"
    )


def test_a_keeper_whose_acting_costs_ttft_is_held_in_shadow_and_drops_nothing_while_held() -> None:
    state = MetricsText()
    rng = random.Random(5)
    now = [0.0]
    with serving(metrics_text_handler(state)) as url:
        act = LMCacheMPActuator(HttpCaller(url, timeout_s=5.0), chunk_size=64, model_name="tiny")
        reader = EngineTtftReader(url)
        reg = CollectorRegistry()
        toks = tuple(range(256))  # 4 chunks
        keeper = L1Keeper(act, chain_tokens=lambda _h: toks, is_active=lambda: True, registry=reg,
                          measure_every_s=10.0, engine_ttft=reader, clock=lambda: now[0],
                          probation_chunks=0)  # fmt: skip
        keeper.core.require_calibration = False
        keeper.core.acting = True  # the L1 guard is not this test's subject
        assert keeper.latency is not None
        ttft_sum = count = l1 = 0.0
        try:
            for _ in range(60):  # 10-minute run of 10 s periods
                slow = keeper.latency.acts_now()  # this period acts: the engine answers a third slower
                ttft_sum += 100 * (0.048 if slow else 0.036) * (1 + rng.gauss(0, 0.03))
                count += 100
                l1 += 640
                state.text = _text(ttft_sum, count, l1)
                now[0] += 10.0
                keeper.step()  # the worker's step at the period's end (clock injected)
                if keeper.latency.trips:
                    break
            assert keeper.latency.trips == 1 and not keeper.latency.acting
            assert not keeper.latency.acts_now()  # a fresh block in shadow starts now
            keeper.on_block_stored(None, 1, 8, 32)  # a new prompt: 4 first-sight chunks
            assert keeper.counts["held_by_latency_guard"] == 4 and keeper.status()["pending"] == 0
            expo = generate_latest(reg).decode()
            assert "kvtier_guard_latency_trips_total 1.0" in expo
            assert "kvtier_guard_latency_acting 0.0" in expo
            assert 'kvtier_guard_latency_periods_total{why="judged"}' in expo
            st = keeper.status()["latency_guard"]
            assert st["verdict"] == "costly" and st["acting"] is False
            lo, _hi = st["acting_minus_shadow_ci95_s"]
            assert lo > 0.05 * 0.036
        finally:
            keeper.stop()


def test_without_an_engine_reader_there_is_no_latency_guard_and_status_answers_without_the_layer() -> None:
    act = LMCacheMPActuator(HttpCaller("http://127.0.0.1:9/", timeout_s=0.2), chunk_size=64, model_name="m")
    keeper = L1Keeper(act, chain_tokens=lambda _h: None, is_active=lambda: True, registry=CollectorRegistry())
    st = keeper.status()  # nothing listens on port 9: /v1/status must still answer
    assert keeper.latency is None and st["latency_guard"] is None
    assert st["residency"]["l2"].startswith("unknown")
