"""The admission bound bench: its oracle and its levers behave as the module doc says (simulator only)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.calibrate_sim import sim_requests
from bench.l1_admission_bound import NEVER, next_use, simulate, store_time_reuse
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


def test_with_the_keepers_calibration_hold_cold_chain_eviction_loses_to_probation_as_it_did_live() -> None:
    """With the keeper's calibration in shadow modelled (``hold_s``: 20 s, the first ~100 requests at the
    512 x 8 rig's pace) the simulator agrees with the live rig: cold-chain eviction (cold_fill 0.75) takes L1
    hits from probation (live: +11.6 % against +19.4 %), and no hit token is lost overall."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 1000))
    d = simulate(sc, reqs, "default", pace_s=0.2, hold_s=20.0)
    p = simulate(sc, reqs, "probation", probation=32, pace_s=0.2, hold_s=20.0)
    c = simulate(sc, reqs, "probation", probation=32, cold_fill=0.75, pace_s=0.2, hold_s=20.0)
    assert p.l1_hit_tokens > c.l1_hit_tokens > 1.05 * d.l1_hit_tokens
    assert c.l1_hit_tokens + c.l2_hit_tokens == d.l1_hit_tokens + d.l2_hit_tokens
    assert c.drops > p.drops and c.policy == "probation 32 + cold 0.75"


def test_a_hold_covering_the_whole_run_acts_never() -> None:
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 200))
    d = simulate(sc, reqs, "default")
    for policy in ("second-sight", "probation", "oracle"):
        r = simulate(sc, reqs, policy, probation=8, hold_s=len(reqs) * 0.25)
        assert (r.l1_hit_tokens, r.l2_hit_tokens, r.drops, r.readmits) == (
            d.l1_hit_tokens,
            d.l2_hit_tokens,
            0,
            0,
        )


def test_store_time_reuse_counts_every_first_sighting_once() -> None:
    reqs = sim_requests(load_workload("bundled", 200))
    distinct = len({int(x) for r in reqs for x in r.hash_ids})
    for vals in store_time_reuse(reqs).values():
        assert sum(c for c, _ in vals.values()) == distinct
        assert all(0.0 <= rate <= 1.0 for _, rate in vals.values())


def test_oracle_prefetch_is_the_ceiling_of_the_prefetch_rows() -> None:
    """Loading each prompt's chunks just before it comes serves from L1 all that L2 holds of it."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 200))
    rows = [simulate(sc, reqs, p, probation=32, prefetch_budget=150) for p in ("probation", "hazard")]
    ceiling = simulate(sc, reqs, "oracle-prefetch")
    assert all(ceiling.l1_hit_tokens > r.l1_hit_tokens for r in rows)
    assert ceiling.l2_hit_tokens < min(r.l2_hit_tokens for r in rows)


def test_readmission_by_gap_adds_l1_hits_to_probation_on_the_bundled_trace_with_fewer_loads() -> None:
    """Declining to readmit the chunks whose gap bin is rarely used again (learned online) leaves L1 to the
    others: more L1 hits with fewer L2 -> L1 loads, and no hit token lost overall."""
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload("bundled", 1000))
    d = simulate(sc, reqs, "default", pace_s=0.2, hold_s=20.0)
    p = simulate(sc, reqs, "probation", probation=32, pace_s=0.2, hold_s=20.0)
    g = simulate(sc, reqs, "probation", probation=32, pace_s=0.2, hold_s=20.0, readmit_by_gap=True)
    assert g.l1_hit_tokens > 1.02 * p.l1_hit_tokens > 1.02 * d.l1_hit_tokens
    assert g.readmits < 0.75 * p.readmits and g.drops == p.drops
    assert g.l1_hit_tokens + g.l2_hit_tokens == d.l1_hit_tokens + d.l2_hit_tokens
    assert g.policy == "probation 32 + gap"
