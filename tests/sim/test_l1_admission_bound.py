"""The admission bound bench: its oracle and its levers behave as the module doc says (simulator only)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.calibrate_sim import sim_requests
from bench.l1_admission_bound import NEVER, AgeHazard, next_use, simulate, store_time_reuse
from bench.live_ab import load_workload, once_again_trace
from kvtier.replay.sim.scenario import load_scenario


def test_next_use_indexes_the_next_request_or_never() -> None:
    assert next_use([[1, 2], [2, 3], [1]]) == [{1: 2, 2: 1}, {2: NEVER, 3: NEVER}, {1: NEVER}]


def test_oracle_bypasses_only_chunks_never_used_again() -> None:
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(once_again_trace(120))  # every prompt comes back once, eight prompts later
    uses = Counter(int(x) for r in reqs for x in r.hash_ids)
    default, oracle = simulate(sc, reqs, "default"), simulate(sc, reqs, "oracle")
    # only the last prompts, whose second sending falls past the trace's end, are bypassed
    assert oracle.drops == sum(1 for n in uses.values() if n == 1) > 0
    assert oracle.l1_hit_tokens == default.l1_hit_tokens
    # second sight drops every first sighting, and a prompt used twice never profits from its readmission
    second = simulate(sc, reqs, "second-sight")
    assert second.drops > 0
    assert second.l1_hit_tokens < default.l1_hit_tokens


@pytest.mark.parametrize("policy", ["second-sight", "probation", "oracle", "hazard", "oracle-prefetch"])
def test_levers_never_lose_a_hit_token_overall(policy: str) -> None:
    """A dropped chunk keeps its L2 copy: L1 + L2 lookup hits stay the default's (hits move between tiers)."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 200))
    d, r = simulate(sc, reqs, "default"), simulate(sc, reqs, policy, probation=16, prefetch_budget=150)
    assert r.l1_hit_tokens + r.l2_hit_tokens == d.l1_hit_tokens + d.l2_hit_tokens
    assert r.drops > 0


def test_store_time_reuse_counts_every_first_sighting_once() -> None:
    reqs = sim_requests(load_workload("bundled", 200))
    distinct = len({int(x) for r in reqs for x in r.hash_ids})
    for vals in store_time_reuse(reqs).values():
        assert sum(c for c, _ in vals.values()) == distinct
        assert all(0.0 <= rate <= 1.0 for _, rate in vals.values())


def test_age_hazard_learns_continuation_ages_from_the_past_and_holds_the_likeliest_chains() -> None:
    h = AgeHazard(bin_requests=4, max_age=40)
    # request 0 opens chain [0, 1, 2]; request 8 continues it (shares chunks beyond the first) at age 8
    h.observe(0, [0, 1, 2])
    for i in range(1, 8):
        h.observe(i, [0, 100 + i])  # prompts sharing only the first chunk: no continuation
    assert h.rate(1, 9) == 0.0  # nothing continued yet: causal, no label from the future
    h.observe(8, [0, 1, 2, 3])
    assert h.cont[1, 2] == 1 and 0 not in h.live and 8 in h.live  # the continued chain is replaced
    assert h.rate(1, 9) > 0.0 and h.rate(5, 9) == 0.0  # age 8 has a continuation, age 4 none
    # two requests later the chains aged 8-11 rank first; the budget (chunks) bounds the held set
    h.observe(9, [0, 200])
    h.observe(10, [0, 201])
    assert h.hold(10, budget=2) == {0, 102}  # request 2 (age 8): the youngest chain of the best bin
    assert h.hold(10, budget=3) == {0, 101, 102}  # then request 1 (age 9); shared chunks count once
    assert h.hold(10, budget=0) == set()


def test_age_hazard_by_turn_keeps_one_rate_per_turn() -> None:
    h = AgeHazard(bin_requests=4, max_age=40, by_turn=True)
    h.observe(0, [0, 1])
    h.observe(4, [0, 1, 2])  # turn 2, continuing a first turn at age 4
    h.observe(8, [0, 1, 2, 3])  # turn 3, continuing a second turn at age 4
    assert h.cont[1, 1] == 1 and h.cont[2, 1] == 1 and h.turn[8] == 3


def test_oracle_prefetch_is_the_ceiling_of_the_prefetch_rows() -> None:
    """Loading each prompt's chunks just before it comes serves from L1 all that L2 holds of it."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 200))
    rows = [simulate(sc, reqs, p, probation=32, prefetch_budget=150) for p in ("probation", "hazard")]
    ceiling = simulate(sc, reqs, "oracle-prefetch")
    assert all(ceiling.l1_hit_tokens > r.l1_hit_tokens for r in rows)
    assert ceiling.l2_hit_tokens < min(r.l2_hit_tokens for r in rows)
