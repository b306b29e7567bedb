"""ReuseByGap (pure): third-sight rates per gap bin, learned from matured samples only; pays vs the mean."""

from __future__ import annotations

from kvtier.policies.reuse_gap import MAX_BIN, ReuseByGap, gap_bin


def test_gap_bins_are_powers_of_two_capped() -> None:
    assert [gap_bin(g) for g in (0, 1, 2, 3, 4, 7, 8, 255, 256)] == [0, 1, 2, 2, 3, 3, 4, 8, 9]
    assert gap_bin(10**9) == MAX_BIN and gap_bin(-5) == 0


def test_a_sample_counts_only_once_it_is_a_horizon_old_and_its_third_sight_only_within_it() -> None:
    r = ReuseByGap(horizon=10, min_samples=1)
    r.observe_second_sight(0, "a", 5)  # bin 3
    r.observe_sight(4, "a")  # third sight within the horizon
    r.observe_second_sight(1, "b", 5)
    r.observe_sight(12, "b")  # after the horizon: no reuse while in L1
    assert r.n[3] == 0 and r.rate(5) is None  # nothing matured yet: the early positive is not counted
    r.observe_second_sight(11, "c", 200)  # matures a (0 + 10 < 11)
    assert (r.n[3], r.pos[3]) == (1, 1)
    r.observe_second_sight(12, "d", 200)  # matures b
    assert (r.n[3], r.pos[3]) == (2, 1) and r.rate(6) == 0.5


def test_pays_for_bins_above_the_mean_and_while_evidence_is_short() -> None:
    r = ReuseByGap(horizon=4, min_samples=10)
    t = 0
    for i in range(20):  # short gaps, always back again; long gaps, never
        r.observe_second_sight(t, ("short", i), 3)
        r.observe_sight(t + 1, ("short", i))
        r.observe_second_sight(t, ("long", i), 300)
        t += 2
        if i == 6:  # 5 matured per bin: too few to judge, both pay
            assert r.pays(t, 3) and r.pays(t, 300) and r.n[2] == r.n[9] == 5
    t += 100
    assert r.pays(t, 3) and not r.pays(t, 300)
    assert r.mean_rate() == 0.5 and r.rate(2) == 1.0 and r.rate(400) == 0.0
    assert r.pays(t, 40)  # a bin never seen: no evidence, it pays
    assert r.status()["bins"] == {"gap<4": [20, 20], "gap<512": [20, 0]}
