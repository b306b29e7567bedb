"""The latency guard's switchback schedule, its washout, its Welch interval and its verdicts."""

from __future__ import annotations

import random

import pytest
from scipy import stats

from kvtier.policies.latency_guard import LatencyGuard, welch_interval


class Engine:
    """vLLM's cumulative TTFT histogram (``_sum`` s, ``_count``) as the guard reads it each period."""

    def __init__(self, seed: int = 0) -> None:
        self.sum, self.count = 0.0, 0.0
        self.rng = random.Random(seed)

    def period(self, mean_s: float, requests: int = 100, noise: float = 0.03) -> tuple[float, float]:
        self.sum += requests * mean_s * (1 + self.rng.gauss(0, noise))
        self.count += requests
        return self.sum, self.count


def run(g: LatencyGuard, eng: Engine, periods: int, ttft: dict[bool, float]) -> list[bool]:
    arms = []
    for _ in range(periods):
        arm = g.acts_now()
        arms.append(arm)
        g.close(*eng.period(ttft[arm]))
    return arms


def test_welch_interval_matches_scipys_welch_test() -> None:
    a = [1.10, 1.32, 1.25, 1.41, 1.18]
    b = [1.00, 0.97, 1.08, 1.02]
    lo, hi = welch_interval(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ci.low, ci.high))
    assert welch_interval([2.0, 2.0], [1.0, 1.0]) == (1.0, 1.0)  # no spread: the difference itself


def test_blocks_of_the_current_state_then_the_other_arm_and_washouts_are_not_judged() -> None:
    g = LatencyGuard(act_periods=4, probe_periods=2, min_periods=100)  # never decides here
    eng = Engine()
    arms = run(g, eng, 12, {True: 0.05, False: 0.05})
    assert arms == [True] * 4 + [False] * 2 + [True] * 4 + [False] * 2
    # period 0 starts the counters; each first period of an arm after a switch is a washout
    assert g.periods == {"start": 1, "judged": 8, "washout": 3}  # switches at periods 4, 6 and 10
    assert g.status()["judged_periods"] == {"acting": 6, "shadow": 2}


def test_acting_that_costs_latency_is_held_in_shadow_and_probes_continue() -> None:
    g = LatencyGuard()
    eng = Engine(seed=1)
    arms = run(g, eng, 60, {True: 0.048, False: 0.036})  # acting: +33 % TTFT (the live A/B's figure)
    assert g.trips == 1 and not g.acting and g.verdict == "costly"
    lo, hi = g.last_interval_s or (0.0, 0.0)
    assert 0.05 * 0.036 < lo < 0.012 < hi
    g2, eng2 = LatencyGuard(), Engine(seed=1)
    while g2.trips == 0:
        run(g2, eng2, 1, {True: 0.048, False: 0.036})
    after = run(g2, eng2, 18, {True: 0.048, False: 0.036})
    assert after == ([False] * 4 + [True] * 2) * 3  # held: blocks of shadow, each ending in two probes
    assert arms.index(False) == 4 and len(arms) - arms[::-1].index(True) > 30  # a control; probes late
    assert g.resumes == 0  # the probes keep confirming the cost


def test_a_held_guard_acts_again_when_acting_stops_costing() -> None:
    g = LatencyGuard()
    eng = Engine(seed=2)
    run(g, eng, 60, {True: 0.048, False: 0.036})
    assert not g.acting
    run(g, eng, 200, {True: 0.036, False: 0.036})  # the cost went away (e.g. the model got bigger)
    assert g.acting and g.resumes == 1 and g.verdict == "fine"


def test_acting_that_does_not_cost_keeps_acting() -> None:
    g = LatencyGuard()
    arms = run(g, Engine(seed=3), 60, {True: 0.030, False: 0.036})  # acting helps
    assert g.acting and g.trips == 0 and g.verdict == "fine"
    assert arms.count(True) == 40  # 4 of every 6 periods act, 2 are the shadow control


def test_quiet_periods_and_engine_restarts_are_not_judged() -> None:
    g = LatencyGuard(min_requests=20)
    assert g.close(10.0, 100).why == "start"
    assert g.close(10.5, 110).why == "too_few"  # 10 requests
    assert g.close(1.0, 20).why == "reset"  # the counters went back: vLLM restarted
    p = g.close(2.0, 60)
    assert p.why == "judged" and p.ttft_mean_s == pytest.approx(0.025) and p.requests == 40


def test_the_same_periods_give_the_same_decisions() -> None:
    def trace() -> list[bool]:
        g = LatencyGuard()
        return run(g, Engine(seed=4), 80, {True: 0.040, False: 0.036})

    assert trace() == trace()
