"""The ``learned`` policy: causality, determinism, fallback, prefix-closure, self-reported quality.

Runs on a generated multi-turn trace (seeded, in memory) and on the real conversation trace (CLI).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.policies.base import Request
from kvtier.policies.learned import LearnedPolicy
from kvtier.policies.predictor import auc, brier, reliability
from kvtier.policies.registry import CLASSIC, get_policy
from kvtier.replay.engine import replay
from kvtier.replay.runner import load_workload
from kvtier.replay.synthetic import multiturn_trace

FAST = {"retrain_every": 200, "horizon_s": 30.0, "min_class": 50}


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return multiturn_trace(2500, seed=3, think_s=10.0, sessions_per_s=4.0)


def _run(reqs: list[Request], cap: int, seed: int = 0) -> tuple[LearnedPolicy, list[bytes], list[list[int]]]:
    pol = LearnedPolicy(cap, seed=seed, **FAST)  # type: ignore[arg-type]
    hits, ev = [], []
    for r in reqs:
        hits.append(pol.access(r).tobytes())
        ev.append(pol.drain_evicted())
    return pol, hits, ev


def test_registered_under_learned(trace: list[Request]) -> None:
    """The registry's ``learned`` is the learned policy with its defaults: it decides exactly like one built
    directly (per-request hit masks over a trace slice)."""
    reqs = trace[:400]
    reg_pol, direct_pol = get_policy("learned", 300, seed=0), LearnedPolicy(300, seed=0)
    assert [reg_pol.access(r).tobytes() for r in reqs] == [direct_pol.access(r).tobytes() for r in reqs]


def test_prefix_run_decides_exactly_like_the_full_run(trace: list[Request]) -> None:
    full_pol, full_hits, full_ev = _run(trace, 300)
    assert full_pol.quality()["retrains"] >= 3  # the model was really trained and refit along the way
    n = 1700
    _, hits, ev = _run(trace[:n], 300)
    assert hits == full_hits[:n]
    assert ev == full_ev[:n]


def test_deterministic_for_a_seed(trace: list[Request]) -> None:
    a = _run(trace, 250, seed=7)
    b = _run(trace, 250, seed=7)
    assert a[1] == b[1] and a[2] == b[2]
    assert a[0].quality() == b[0].quality()


def test_fallback_until_trained_evicts_the_partial_tail_first() -> None:
    pol = LearnedPolicy(4)
    # two 2-block requests at t=0: the first fills its last block, the second ends in a partial block
    pol.access(Request(0.0, 1024, 10, np.array([1, 2], dtype=np.int64)))
    pol.access(Request(0.0, 700, 10, np.array([3, 4], dtype=np.int64)))
    pol.drain_evicted()
    pol.access(Request(1.0, 100, 10, np.array([5], dtype=np.int64)))
    assert not pol.model.trained
    assert pol.drain_evicted() == [4]  # LRU would have dropped block 1 (oldest), breaking chain 1-2
    assert pol.contains(1) and pol.contains(2) and pol.contains(3) and pol.contains(5)
    ex = pol.explain(4)
    assert ex["known"] and not ex["resident"] and ex["features"]["partial_tail"] == 1.0


def test_resident_set_stays_prefix_closed_and_within_capacity(trace: list[Request]) -> None:
    cap = 120
    pol = LearnedPolicy(cap, **FAST)  # type: ignore[arg-type]
    parent: dict[int, int] = {}
    resident: set[int] = set()
    for r in trace:
        ids = r.hash_ids.tolist()
        for i in range(1, len(ids)):
            parent[ids[i]] = ids[i - 1]
        h = pol.access(r)
        k = int(h.sum())
        assert h[:k].all() and not h[k:].any()  # hits are a prefix of the request
        resident |= {b for b in ids if pol.contains(b)}
        resident -= set(pol.drain_evicted())
        assert len(pol) == len(resident) <= cap
        for b in resident:
            assert b not in parent or parent[b] in resident


def test_beats_every_classic_on_the_conversation_trace_at_2pct() -> None:
    """Real trace, default settings: 2 % capacity is where admission matters most (best classic: S3-FIFO)."""
    wl = load_workload("bundled")
    cap = round(0.02 * wl.distinct_blocks)
    classic = {n: replay(wl.requests, get_policy(n, cap, 0)).prefix_hit_ratio for n in CLASSIC}
    pol = get_policy("learned", cap, 0)
    learned = replay(wl.requests, pol).prefix_hit_ratio
    assert learned > max(classic.values()) + 0.02, (learned, classic)
    q = pol.quality()  # type: ignore[attr-defined]
    assert q["trained"] and q["auc"] > 0.6


def test_quality_reports_out_of_sample_auc_after_training(trace: list[Request]) -> None:
    pol, _, _ = _run(trace, 300)
    q = pol.quality()
    assert q["trained"] and q["scored_accesses"] > 1000
    assert q["auc"] > 0.6  # out-of-sample: partial tails never return here, sessions end at random
    assert q["auc_first_touch"] is not None and q["auc_retouched"] is not None
    assert 0.0 <= q["brier"] <= 0.25
    assert sum(b["count"] for b in q["reliability"]) == q["scored_accesses"]
    assert q["windows"] >= 1 and 0 <= q["windows_beat_fallback"] <= q["windows"]


def test_quality_metrics_on_a_hand_made_case() -> None:
    y = np.array([0, 0, 1, 1], dtype=bool)
    assert auc(y, np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert auc(y, np.array([0.5, 0.5, 0.5, 0.5])) == pytest.approx(0.5)
    assert auc(y, np.array([0.0, 0.1, 0.2, 0.3])) == pytest.approx(1.0)
    assert auc(np.array([1, 1], dtype=bool), np.array([0.2, 0.3])) is None
    assert brier(np.array([0, 1], dtype=bool), np.array([0.5, 1.0])) == pytest.approx(0.125)
    bins = reliability(np.array([0, 1, 1, 0], dtype=bool), np.array([0.05, 0.95, 0.91, 0.5]), n_bins=10)
    assert [(b["lo"], b["count"], b["observed"]) for b in bins] == [
        (0.0, 1, 0.0),
        (0.5, 1, 0.0),
        (0.9, 2, 1.0),
    ]


def test_cli_max_requests_writes_the_first_lines_of_the_full_run(tmp_path: Path) -> None:
    """Real conversation trace through the real CLI: a 3000-request run is a prefix of the full run."""
    out = {}
    for name, extra in (("full", []), ("head", ["--max-requests", "3000"])):
        f = tmp_path / f"{name}.jsonl"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "replay",
                "bundled",
                "--policy",
                "learned",
                "--capacity-blocks",
                "3656",
                "--per-request",
                str(f),
                "--format",
                "json",
                *extra,
            ],
            check=True,
            stdout=subprocess.PIPE,
        )
        out[name] = f.read_text().splitlines()
    assert len(out["head"]) == 3000 and len(out["full"]) == 12031
    assert out["head"] == out["full"][:3000]
    assert sum(json.loads(x)["prefix_hit_tokens"] for x in out["head"]) > 0


def test_expert_switch_needs_a_significant_paired_lead() -> None:
    """Hand-set paired statistics: a noisy lead does not switch, a clear one does (and is logged)."""
    pol = LearnedPolicy(
        100, learned_mults=(0.25, 1.0, 4.0), heuristic_mults=(), experts=(), switch_margin=1.03
    )
    assert pol.expert_names == ["learned-tau-x0.25", "learned", "learned-tau-x4"]
    assert pol._real.mult == 1.0 and pol.quality()["expert"] == "learned"
    # expert 2 got 20 % more tokens, but per-request differences are so noisy the lead is < 1 s.e.
    pol._ex_S[:] = (100.0, 1000.0, 1200.0)
    pol._ex_D[2, 1], pol._ex_Q[2, 1] = 200.0, 1e6
    pol._follow_leader()
    assert pol._real.mult == 1.0 and pol.switch_log == []
    # expert 0 has a consistent paired lead but fewer total tokens than the margin requires: no switch
    pol._ex_D[0, 1], pol._ex_Q[0, 1] = 50.0, 10.0
    pol._follow_leader()
    assert pol._real.mult == 1.0
    # now expert 2's lead is consistent (many small positive differences): it takes over
    pol._ex_Q[2, 1] = 200.0**2 / 9.0  # z = 3
    pol._follow_leader()
    assert pol._real.mult == 4.0 and pol.quality()["expert"] == "learned-tau-x4"
    (sw,) = pol.switch_log
    assert sw["from"] == "learned" and sw["to"] == "learned-tau-x4" and sw["z"] == pytest.approx(3.0)


def test_leaving_the_home_expert_takes_home_z_but_coming_back_takes_switch_z() -> None:
    """Asymmetric hysteresis: with ``home_z`` 2 a lead of 1.5 s.e. does not pull the real cache off its
    starting expert, 2.5 s.e. does; from there a 1 s.e. lead of the home expert is enough to return."""
    pol = LearnedPolicy(
        100, learned_mults=(1.0, 8.0), heuristic_mults=(), experts=(), switch_margin=1.0, home_z=2.0
    )
    assert pol.home_z == 2.0 and pol.switch_z == 0.5 and pol._real.mult == 1.0
    pol._ex_S[:] = (1000.0, 1100.0)
    pol._ex_D[1, 0], pol._ex_Q[1, 0] = 100.0, (100.0 / 1.5) ** 2  # z = 1.5 < home_z
    pol._follow_leader()
    assert pol.switch_log == [] and pol._real.mult == 1.0
    pol._ex_Q[1, 0] = (100.0 / 2.5) ** 2  # z = 2.5
    pol._follow_leader()
    assert pol._real.mult == 8.0 and pol.switch_log[-1]["to"] == "learned-tau-x8"
    pol._ex_S[:] = (1100.0, 1000.0)
    pol._ex_D[0, 1], pol._ex_Q[0, 1] = 100.0, 100.0**2  # z = 1: below home_z, above switch_z
    pol._follow_leader()
    assert pol._real.mult == 1.0 and pol.switch_log[-1]["to"] == "learned"
    assert LearnedPolicy(100).home_z == LearnedPolicy(100).switch_z  # default: no asymmetry


def test_going_back_to_the_expert_just_left_takes_return_z() -> None:
    """Anti-whipsaw (round 12): after a switch c -> j, a lead of c over j below ``return_z`` s.e. does not
    switch back within ``return_within`` requests (it would with the rule off); an expert that was not
    just left needs only ``switch_z``, and once ``return_within`` has passed so does c."""

    def switched_away() -> LearnedPolicy:
        p = LearnedPolicy(
            100, learned_mults=(1.0, 8.0, 0.1), heuristic_mults=(), experts=(), switch_margin=1.0
        )
        p._ex_S[:] = (1000.0, 1100.0, 900.0)
        p._ex_D[1, 0], p._ex_Q[1, 0] = 300.0, 100.0**2  # z = 3
        p._requests = 1000
        p._follow_leader()
        assert p.expert_names[p._lead] == "learned-tau-x8" and p._real.mult == 8.0
        # one window later the home expert leads again, by 0.8 s.e.: above switch_z, below return_z
        p._requests = 1100
        p._ex_S[:] = (1100.0, 1000.0, 900.0)
        p._ex_D[0, 1], p._ex_Q[0, 1] = 80.0, 100.0**2
        return p

    pol = switched_away()
    assert pol.return_z == 1.0 and pol.return_within == 1500 and pol.switch_z == 0.5
    pol._follow_leader()
    assert pol._real.mult == 8.0 and len(pol.switch_log) == 1  # no whipsaw back
    pol._ex_Q[0, 1] = (80.0 / 1.2) ** 2  # z = 1.2 >= return_z: a clear lead brings it back
    pol._follow_leader()
    assert pol._real.mult == 1.0 and pol.switch_log[-1]["to"] == "learned"

    off = switched_away()
    off.return_z = None  # the rule off: the same 0.8 s.e. lead switches straight back
    off._follow_leader()
    assert off._real.mult == 1.0 and off.switch_log[-1]["to"] == "learned"

    late = switched_away()
    late._requests = 1000 + late.return_within + 100  # long after the switch: switch_z again
    late._follow_leader()
    assert late._real.mult == 1.0

    other = switched_away()  # the bar is only for the expert just left: a third one needs switch_z
    other._ex_S[:] = (1000.0, 1000.0, 1100.0)
    other._ex_D[0, 1] = 0.0
    other._ex_D[2, 1], other._ex_Q[2, 1] = 80.0, 100.0**2
    other._follow_leader()
    assert other._real.mult == 0.1 and other.switch_log[-1]["to"] == "learned-tau-x0.1"


def test_expert_switches_on_a_real_stream_only_go_to_better_experts() -> None:
    """Shared-document trace (frequency matters, so a frequency-heavy expert should win at some point)."""
    from kvtier.replay.synthetic import shared_document_trace

    reqs = shared_document_trace(2500, seed=2)
    pol = LearnedPolicy(2000, **FAST)  # type: ignore[arg-type]
    replay(reqs, pol)
    assert pol.switch_log, "expected at least one switch on a frequency-heavy trace"
    for sw in pol.switch_log:
        assert sw["to_score"] > pol.switch_margin * sw["from_score"]
        assert sw["z"] > pol.switch_z
    q = pol.quality()
    assert q["expert"] == pol.switch_log[-1]["to"] and q["expert_switches"] == len(pol.switch_log)
    assert set(q["expert_scores"]) == {"learned-tau-x0.1", "learned", "heuristic-x16", "arc"}


def test_classic_expert_is_a_full_size_shadow_of_the_policy_itself(trace: list[Request]) -> None:
    """The ARC expert sees every request at full capacity: its hits equal a standalone ARC's, and the
    per-block membership the real cache follows equals ARC's own ``contains``."""
    cap = 150
    pol = LearnedPolicy(cap, **FAST)  # type: ignore[arg-type]
    arc = get_policy("arc", cap)
    toks = 0.0
    for r in trace[:1500]:
        pol.access(r)
        h = arc.access(r)
        arc.drain_evicted()
        n = h.shape[0]
        lead = n if h.all() else int(h.argmin())
        toks = toks * pol.expert_decay + (r.input_length if lead == n else lead * r.block_tokens)
    assert pol.quality()["expert_scores"]["arc"] == pytest.approx(toks)
    member = pol._member[0]
    seen = {int(b): pol._slot[int(b)] for r in trace[:1500] for b in r.hash_ids.tolist()}
    assert sum(arc.contains(b) for b in seen) == cap
    assert all(bool(member[s]) == arc.contains(b) for b, s in seen.items())


def test_following_a_classic_expert_hands_off_contents_and_converges(trace: list[Request]) -> None:
    """After a switch to ARC the real cache keeps exactly its contents (no block appears without a
    miss), then converges to ARC's resident set by its own misses -- closer than the same policy that
    did not switch; prefix-closure and capacity hold (checked by the other tests' invariants too)."""
    cap = 150
    pols = [LearnedPolicy(cap, switch_every=10**9, **FAST) for _ in range(2)]  # type: ignore[arg-type]
    for r in trace[:800]:
        for p in pols:
            p.access(r)
    pol, ctrl = pols
    ids = {int(b) for r in trace for b in r.hash_ids.tolist()}
    before = {b for b in ids if pol.contains(b)}
    a = pol.expert_names.index("arc")
    c = pol._lead
    pol._ex_S[a], pol._ex_D[a, c], pol._ex_Q[a, c] = 2 * pol._ex_S[c] + 1.0, 100.0, 1.0
    pol._follow_leader()
    assert pol.quality()["expert"] == "arc" and pol.switch_log[-1]["to"] == "arc"
    assert ctrl.quality()["expert"] == "learned"
    assert {b for b in ids if pol.contains(b)} == before  # hand-off: same contents

    def overlap(p: LearnedPolicy) -> float:
        """Share of the real cache's blocks that the ARC expert holds too."""
        res = [p._slot[b] for b in ids if p.contains(b)]
        return float(np.mean(p._member[0][res]))

    for r in trace[800:1600]:
        for p in pols:
            p.access(r)
            assert len(p) <= cap
    assert overlap(pol) > overlap(ctrl) + 0.05, (overlap(pol), overlap(ctrl))


@pytest.mark.parametrize("cap", [1, 5, 37])
def test_pinning_never_exceeds_capacity_when_a_request_is_longer_than_the_cache(cap: int) -> None:
    pol = LearnedPolicy(cap)
    long = Request(0.0, 60 * 512, 10, np.arange(100, 160, dtype=np.int64))
    h = pol.access(long)
    assert not h.any() and len(pol) <= cap
    # what stayed is the request's own prefix (the in-flight chain), so the repeat hits exactly that
    kept = sum(pol.contains(b) for b in range(100, 160))
    assert kept == len(pol) and all(pol.contains(b) for b in range(100, 100 + kept))
    h2 = pol.access(Request(1000.0, 60 * 512, 10, np.arange(100, 160, dtype=np.int64)))
    assert int(h2.sum()) == kept and h2[:kept].all() and len(pol) <= cap


def test_tight_cache_on_long_documents_stays_prefix_closed_and_within_capacity() -> None:
    """Capacity close to the longest request (Mooncake-synthetic-like trace, 1 % of its blocks)."""
    from kvtier.replay.synthetic import long_document_trace

    reqs = long_document_trace(600, seed=4)
    longest = max(len(r.hash_ids) for r in reqs)
    cap = longest + 5
    pol = LearnedPolicy(cap, **FAST)  # type: ignore[arg-type]
    parent: dict[int, int] = {}
    resident: set[int] = set()
    for r in reqs:
        ids = r.hash_ids.tolist()
        parent.update(zip(ids[1:], ids[:-1], strict=True))
        pol.access(r)
        resident |= {b for b in ids if pol.contains(b)}
        resident -= set(pol.drain_evicted())
        assert len(pol) == len(resident) <= cap
        assert all(b not in parent or parent[b] in resident for b in resident)


def test_non_tree_requests_fall_back_to_the_general_slot_path() -> None:
    """A block repeated within a request, and a known block after a new one, are still served."""
    pol = LearnedPolicy(10)
    pol.access(Request(0.0, 3 * 512, 1, np.array([1, 2, 3], dtype=np.int64)))
    h = pol.access(Request(1.0, 4 * 512, 1, np.array([1, 9, 3, 3], dtype=np.int64)))
    assert h.tolist()[:1] == [True] and pol.contains(9)
    assert len(pol) <= 10
    pol.access(Request(2.0, 4 * 512, 1, np.array([5, 6, 6, 7], dtype=np.int64)))  # a new block twice
    s1, s2, s3, s9, s5, s6, s7 = pol.slots_of([1, 2, 3, 9, 5, 6, 7]).tolist()
    assert sorted([s1, s2, s3, s9, s5, s6, s7]) == list(range(7))  # one slot per distinct block
    par, kids = pol._parent.tolist(), pol._children.tolist()
    assert (par[s9], par[s3], par[s2], par[s1]) == (s1, s2, s1, -1)  # a known block keeps its parent
    assert (par[s5], par[s6], par[s7]) == (-1, s5, s6)  # the repeat is not its own parent
    assert (kids[s1], kids[s2], kids[s5], kids[s6]) == (2, 1, 1, 1)


def test_long_document_trace_is_seeded_and_shaped_like_the_synthetic_trace() -> None:
    from collections import Counter

    from kvtier.replay.synthetic import long_document_trace

    a, b = long_document_trace(3993, seed=1), long_document_trace(3993, seed=1)
    assert all(
        np.array_equal(x.hash_ids, y.hash_ids) and x.timestamp_ms == y.timestamp_ms
        for x, y in zip(a, b, strict=True)
    )
    counts = Counter(i for r in a for i in r.hash_ids.tolist())
    once = sum(v == 1 for v in counts.values()) / len(counts)
    assert 0.5 < once < 0.66  # synthetic: 58 % of blocks used once
    assert max(len(r.hash_ids) for r in a) <= 374
    assert a[-1].timestamp_ms <= 1020 * 1000.0


def test_folded_expert_statistics_equal_the_per_request_recurrence() -> None:
    """Buffered windows give the same decayed S, D, Q as updating after every request."""
    rng = np.random.default_rng(5)
    pol = LearnedPolicy(10, learned_mults=(1.0, 32.0), experts=("arc",), switch_every=7)
    k = len(pol.expert_names)
    S, D, Q = np.zeros(k), np.zeros((k, k)), np.zeros((k, k))
    r = pol.expert_decay
    for _ in range(3):
        rows = rng.integers(0, 3, size=(7, k)).astype(float) * 512
        for t in rows:
            d = t[:, None] - t[None, :]
            S, D, Q = r * S + t, r * D + d, r * Q + d * d
        pol._tok_buf[:] = rows
        pol._n_buf = 7
        pol._fold_expert_stats()
    np.testing.assert_allclose(pol._ex_S, S)
    np.testing.assert_allclose(pol._ex_D, D, atol=1e-9)
    np.testing.assert_allclose(pol._ex_Q, Q)


def test_lead_bias_is_carried_exactly_by_the_blocks_the_followed_expert_holds(trace: list[Request]) -> None:
    """After a switch to ARC the real cache ranks by its learned key plus ``lead_bias`` log-odds for the
    blocks ARC holds (a soft preference, not an absolute one): after every request each resident key is
    the learned key of the block's last access plus the bias exactly when ARC holds it (a block ARC
    drops loses the bias at once)."""
    cap = 150
    pol = LearnedPolicy(cap, switch_every=10**9, **FAST)  # type: ignore[arg-type]
    assert pol.lead_bias == 3.0
    for r in trace[:800]:
        pol.access(r)
    a, c = pol.expert_names.index("arc"), pol._lead
    pol._ex_S[a], pol._ex_D[a, c], pol._ex_Q[a, c] = 2 * pol._ex_S[c] + 1.0, 100.0, 1.0
    pol._follow_leader()
    assert pol.quality()["expert"] == "arc" and not pol._aliased()
    mixed = 0
    for r in trace[800:1600]:
        pol.access(r)
        res = np.flatnonzero(pol._real.resident[: pol._n_slots])
        held = pol._member[0][res]
        mixed += int(held.any() and not held.all())
        z = pol._logit_of_events(pol._last_event[res])
        learned = z + pol._last_ms[res] / 1000.0 / (pol.tau_s * pol._real.mult)
        # (the re-keyed part reads float32-stored features, so a value on a bin edge may shift z a little)
        carried = np.rint((pol._real.key[res] - learned) / pol.lead_bias)
        assert np.array_equal(carried, held.astype(float))
    assert mixed > 400  # both kinds resident most of the time: the preference is soft


def test_default_expert_set_is_model_recency_scales_a_heuristic_frequency_expert_and_arc() -> None:
    """Round 11: the frequency-weighted expert is keyed by the fixed heuristic (the fallback), not by the
    model, whose labels lag; the round-10 set stays reachable."""
    pol = LearnedPolicy(100)
    assert pol.expert_names == ["learned-tau-x0.1", "learned", "heuristic-x16", "arc"]
    assert [p.heuristic for p in pol._keyed] == [False, False, True] and not pol._real.heuristic
    assert pol.classic_key == "best"
    old = LearnedPolicy(100, learned_mults=(0.1, 1.0, 16.0), heuristic_mults=(), classic_key="keep")
    assert old.expert_names == ["learned-tau-x0.1", "learned", "learned-tau-x16", "arc"]
    assert not any(p.heuristic for p in old._keyed)
    with pytest.raises(ValueError):
        LearnedPolicy(100, classic_key="nope")


def test_heuristic_expert_keys_by_the_heuristic_log_odds_whatever_the_model(trace: list[Request]) -> None:
    """A heuristic expert's key of a block is the heuristic log-odds of its last access plus t / (tau x
    mult) with the fallback's fixed tau, before and after the model is trained and refit."""
    from kvtier.policies.heuristic import HeuristicPredictor

    pol = LearnedPolicy(150, learned_mults=(1.0,), heuristic_mults=(16.0,), experts=(), **FAST)  # type: ignore[arg-type]
    h = pol._keyed[1]
    assert h.heuristic and h.mult == 16.0
    for r in trace[:1500]:
        pol.access(r)
        res = np.flatnonzero(h.resident[: pol._n_slots])
        zf = HeuristicPredictor.log_odds(pol._ev_x[pol._last_event[res] % pol._E])
        want = zf + pol._last_ms[res] / 1000.0 / (pol.heuristic.tau_s * 16.0)
        np.testing.assert_allclose(h.key[res], want, rtol=0, atol=1e-5)  # (stored features are float32)
    assert pol.quality()["retrains"] >= 3


def test_following_a_heuristic_expert_keys_the_real_cache_by_the_heuristic(trace: list[Request]) -> None:
    """A switch to a heuristic expert makes the real cache rank by the heuristic key (plus the lead bias
    on the blocks the expert holds); a switch to ARC with ``classic_key`` "best" makes it rank by the key of
    the keyed expert with the most recent tokens, "keep" leaves its key as it was."""
    from kvtier.policies.heuristic import HeuristicPredictor

    pols = [LearnedPolicy(150, switch_every=10**9, classic_key=ck, **FAST) for ck in ("best", "keep")]  # type: ignore[arg-type]
    for r in trace[:800]:
        for p in pols:
            p.access(r)
    pol = pols[0]
    hx = pol.expert_names.index("heuristic-x16")
    c = pol._lead
    pol._ex_S[hx], pol._ex_D[hx, c], pol._ex_Q[hx, c] = 2 * pol._ex_S[c] + 1.0, 100.0, 1.0
    pol._follow_leader()
    assert pol._real.heuristic and pol._real.mult == 16.0 and not pol._aliased()
    for r in trace[800:1000]:
        pol.access(r)
        res = np.flatnonzero(pol._real.resident[: pol._n_slots])
        zf = HeuristicPredictor.log_odds(pol._ev_x[pol._last_event[res] % pol._E])
        own = zf + pol._last_ms[res] / 1000.0 / (pol.heuristic.tau_s * 16.0)
        carried = np.rint((pol._real.key[res] - own) / pol.lead_bias)
        assert np.array_equal(carried, pol._keyed[hx].resident[res].astype(float))
    for p in pols:
        a, c = p.expert_names.index("arc"), p._lead
        before = (p._real.mult, p._real.heuristic)
        p._ex_S[:a] = (5.0, 1.0, 3.0)  # the model at x0.1 has the most recent tokens among the keyed ones
        p._ex_S[a], p._ex_D[a, c], p._ex_Q[a, c] = 100.0, 100.0, 1.0
        p._follow_leader()
        assert p.quality()["expert"] == "arc"
        want = (0.1, False) if p.classic_key == "best" else before
        assert want != before or p is pols[1]
        assert (p._real.mult, p._real.heuristic) == want
