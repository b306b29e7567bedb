"""Planner: value ordering, link budgets, watermarks, hysteresis, pins, last-copy safety (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.planner import BlockView, LinkBudget, Plan, Planner, PlannerConfig, tier_bit
from kvtier.policies.tiers import Tier, TierSpec

G, C, D = tier_bit(Tier.GPU), tier_bit(Tier.CPU), tier_bit(Tier.DISK)


def view(
    masks: list[int],
    p: list[float],
    *,
    tokens: int = 32,
    nbytes: int = 1000,
    admittable: list[bool] | None = None,
) -> BlockView:
    n = len(masks)
    return BlockView(
        hashes=np.arange(1, n + 1, dtype=np.int64),
        tier_mask=np.array(masks, np.uint8),
        tokens=np.full(n, tokens, np.int32),
        nbytes=np.full(n, nbytes, np.int64),
        p_reuse=np.array(p, np.float32),
        admittable=np.array(admittable if admittable is not None else [False] * n, np.bool_),
    )


def cfg(gpu_cap: int = 4, cpu_cap: int = 100, **kw: object) -> PlannerConfig:
    return PlannerConfig(
        tiers=(
            TierSpec(Tier.GPU, gpu_cap, 0.75, 0.5, 1e12),
            TierSpec(Tier.CPU, cpu_cap, 0.9, 0.8, 1e9),
            TierSpec(Tier.DISK, 1000, 0.9, 0.8, 1e8),
        ),
        **kw,  # type: ignore[arg-type]
    )


def test_promotes_highest_value_first_within_room() -> None:
    # gpu cap 4, high 0.75 -> 3 slots, 1 used -> room 2; four cpu blocks with different P(reuse)
    v = view([G, C, C, C, C], [0.9, 0.1, 0.8, 0.5, 0.95])
    plan = Planner(cfg()).plan(v, 0.0)
    assert [(m.action, m.block) for m in plan.moves] == [("prefetch", 5), ("prefetch", 3)]
    assert plan.moves[0].value_s > plan.moves[1].value_s > 0


def test_value_is_p_times_prefill_saved_minus_load_time() -> None:
    pl = Planner(cfg(prefill_s_per_token=1e-3))
    v = view([C], [0.5], tokens=100, nbytes=10**9)
    # gpu: 0.5*(0.1 - 1e9/1e12) ; cpu: 0.5*(0.1 - 1)
    assert pl.value(v, Tier.GPU)[0] == pytest.approx(0.5 * (0.1 - 1e-3))
    assert pl.value(v, Tier.CPU)[0] == pytest.approx(0.5 * (0.1 - 1.0))


def test_ops_budget_spent_on_highest_value_and_rest_deferred() -> None:
    c = cfg(gpu_cap=100, default_budget=LinkBudget(bytes_per_s=1e12, ops_per_s=2, burst_s=1))
    v = view([C] * 5, [0.2, 0.9, 0.4, 0.8, 0.1])
    pl = Planner(c)
    plan = pl.plan(v, 0.0)
    assert [m.block for m in plan.moves] == [2, 4]
    assert plan.tried["prefetch"] == 5 and plan.deferred["prefetch"] == 3
    # bucket refills with time: 1 s later, 2 more ops
    pl.commit(plan.moves, 0.0)
    plan2 = pl.plan(v, 1.0)
    assert [m.block for m in plan2.moves] == [3, 1]


def test_byte_budget_limits_moves() -> None:
    c = cfg(gpu_cap=100, default_budget=LinkBudget(bytes_per_s=2500, ops_per_s=100, burst_s=1))
    plan = Planner(c).plan(view([C] * 4, [0.9, 0.8, 0.7, 0.6], nbytes=1000), 0.0)
    assert len(plan.moves) == 2 and plan.deferred["prefetch"] == 2


def test_high_watermark_sheds_lowest_value_to_low_watermark() -> None:
    # gpu cap 4: high 3, low 2; 4 resident -> shed 2 lowest value
    v = view([G, G, G, G], [0.9, 0.1, 0.5, 0.2])
    plan = Planner(cfg()).plan(v, 0.0)
    assert sorted((m.action, m.block, m.dst) for m in plan.moves) == [
        ("demote", 2, Tier.CPU),
        ("demote", 4, Tier.CPU),
    ]


def test_evict_only_redundant_copies_never_last_copy() -> None:
    # block 1 also on cpu -> gpu copy may be evicted; disk is the last tier: over-full disk holds last copies
    c = PlannerConfig(tiers=(TierSpec(Tier.GPU, 2, 0.5, 0.5), TierSpec(Tier.DISK, 1, 0.0, 0.0)))
    v = view([G | D, G], [0.1, 0.9])
    plan = Planner(c).plan(v, 0.0)
    acts = {(m.action, m.block, m.src, m.dst) for m in plan.moves}
    assert ("evict", 1, Tier.GPU, None) in acts
    assert not any(m.action == "evict" and m.src is Tier.DISK for m in plan.moves)
    assert plan.held["last_copy"] == 1  # disk over its watermark, block 1's disk copy is its last


def test_repeated_tick_after_commit_is_a_noop_and_no_ping_pong() -> None:
    pl = Planner(cfg(hysteresis_s=30))
    v = view([G, G, G, G], [0.9, 0.1, 0.5, 0.2])
    plan = pl.plan(v, 0.0)
    pl.commit(plan.moves, 0.0)
    assert pl.plan(v, 1.0).moves == []
    # the demoted blocks land on cpu; gpu has room again; they must not bounce back within hysteresis
    v2 = view([G, C, G, C], [0.9, 0.1, 0.5, 0.95])
    again = pl.plan(v2, 5.0)
    assert [m for m in again.moves if m.block in (2, 4)] == []
    assert pl.plan(v2, 40.0).moves[0].block == 4  # after the window the valuable one may come back


def test_pins_honoured_first_and_never_shed() -> None:
    c = cfg(default_budget=LinkBudget(bytes_per_s=1e12, ops_per_s=1, burst_s=1))
    # gpu over high watermark; block 2 pinned to gpu must not be demoted; block 5 pinned but on cpu -> promote
    v = view([G, G, G, G, C], [0.9, 0.0, 0.5, 0.6, 0.0])
    plan = Planner(c).plan(v, 0.0, pins={2: Tier.GPU, 5: Tier.GPU}, pinned_at_layer={2})
    assert plan.moves[0].block == 5 and plan.moves[0].pinned  # the only op of the budget goes to the pin
    assert all(m.block != 2 for m in plan.moves)
    assert plan.held["pinned"] >= 1


def test_pin_action_when_resident_but_not_acknowledged() -> None:
    plan = Planner(cfg()).plan(view([C], [0.0]), 0.0, pins={1: Tier.CPU})
    assert [(m.action, m.block, m.dst) for m in plan.moves] == [("pin", 1, Tier.CPU)]
    assert Planner(cfg()).plan(view([C], [0.0]), 0.0, pins={1: Tier.CPU}, pinned_at_layer={1}).moves == []


def test_pin_of_untracked_block_admitted_when_tokens_known() -> None:
    pl = Planner(cfg())
    plan = pl.plan(BlockView.empty(), 0.0, pins={77: Tier.GPU, 78: Tier.GPU}, pin_admittable={77})
    assert [(m.action, m.block) for m in plan.moves] == [("admit", 77)]
    assert plan.held["pin_unknown_tokens"] == 1
    pl.commit(plan.moves, 0.0)
    assert pl.plan(BlockView.empty(), 1.0, pins={77: Tier.GPU}, pin_admittable={77}).moves == []
    assert len(pl.plan(BlockView.empty(), 6.0, pins={77: Tier.GPU}, pin_admittable={77}).moves) == 1


def test_admit_non_resident_only_when_admittable_and_likely() -> None:
    v = view([0, 0, 0], [0.9, 0.9, 0.01], admittable=[True, False, True])
    plan = Planner(cfg(gpu_cap=100)).plan(v, 0.0)
    assert [(m.action, m.block) for m in plan.moves] == [("admit", 1)]


def test_allowed_filters_actions() -> None:
    v = view([G, G, G, G, C], [0.9, 0.1, 0.5, 0.2, 0.9])
    plan = Planner(cfg()).plan(v, 0.0, allowed={"prefetch"})
    assert all(m.action == "prefetch" for m in plan.moves)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="watermark"):
        TierSpec(Tier.GPU, 10, high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(ValueError, match="duplicate"):
        PlannerConfig(tiers=(TierSpec(Tier.GPU, 1), TierSpec(Tier.GPU, 2)))


@pytest.mark.parametrize("seed", range(4))
def test_desired_tier_pruned_ranking_equals_ranking_every_candidate(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many more fill / shed candidates than moves fit the budgets (a policy-placed tier, and a tier
    above its high watermark), the planner ranks only the rows whose value bound can reach the k-th best
    of the likeliest ones; the moves (blocks, actions, values, order) and the tried / deferred counts
    equal those of ranking every candidate. Mixed block sizes, token counts and source tiers."""
    import kvtier.policies.planner as planner_mod

    rng = np.random.default_rng(seed)
    n = 60_000
    mask = rng.choice(np.array([0, 1, 2, 3, 4, 6], np.uint8), n, p=[0.3, 0.05, 0.25, 0.05, 0.25, 0.1])
    want = rng.random(n) < 0.4
    v = BlockView(
        np.arange(1, n + 1, dtype=np.int64),
        mask,
        rng.integers(1, 64, n).astype(np.int32),
        rng.integers(1 << 14, 1 << 20, n).astype(np.int64),
        (rng.random(n) ** 3).astype(np.float32),
        np.zeros(n, np.bool_),
    )
    c = PlannerConfig(
        tiers=(
            TierSpec(Tier.GPU, 4000, load_bandwidth_bytes_s=1e12),
            TierSpec(Tier.CPU, 30_000, load_bandwidth_bytes_s=2e10),
            TierSpec(Tier.DISK, n, load_bandwidth_bytes_s=2e9),
        ),
        default_budget=LinkBudget(bytes_per_s=1e12, ops_per_s=500.0),
    )
    kept: list[tuple[int, int]] = []
    vb = planner_mod.ValueBounds
    lowest, highest = vb.lowest_candidates, vb.highest_gain_candidates
    lowest_m, highest_m = vb.lowest_in_mask, vb.highest_gain_in_mask

    def spy(fn):  # type: ignore[no-untyped-def]
        def f(self, rows, *a):  # type: ignore[no-untyped-def]
            out = fn(self, rows, *a)
            kept.append((rows.size if rows.dtype != np.bool_ else int(rows.sum()), out.size))
            return out

        return f

    for name, fn in (
        ("lowest_candidates", lowest),
        ("highest_gain_candidates", highest),
        ("lowest_in_mask", lowest_m),
        ("highest_gain_in_mask", highest_m),
    ):
        monkeypatch.setattr(vb, name, spy(fn))
    pruned = Planner(c).plan(v, 10.0, desired={Tier.CPU: want})
    # shed + fill of the desired tier (bounded on their masks), and the gpu tier's watermark shedding: each
    # pruned (the mask variants do not call the row variants when their sample is usable)
    assert len(kept) == 3 and all(after < before / 3 for before, after in kept)
    monkeypatch.setattr(vb, "lowest_candidates", lambda self, rows, *a: rows)
    monkeypatch.setattr(vb, "highest_gain_candidates", lambda self, rows, *a: rows)
    monkeypatch.setattr(vb, "lowest_in_mask", lambda self, mask, *a: np.flatnonzero(mask))
    monkeypatch.setattr(vb, "highest_gain_in_mask", lambda self, mask, *a: np.flatnonzero(mask))
    full = Planner(c).plan(v, 10.0, desired={Tier.CPU: want})
    assert len(pruned.moves) > 400
    assert [(m.action, m.block, m.src, m.dst, m.value_s) for m in pruned.moves] == [
        (m.action, m.block, m.src, m.dst, m.value_s) for m in full.moves
    ]
    assert pruned.tried == full.tried and pruned.deferred == full.deferred and pruned.held == full.held


@pytest.mark.parametrize(
    ("seed", "gpu_count", "mixed"), [(0, 3_600, True), (1, 3_600, False), (2, 1_000, True), (3, 1_000, False)]
)
def test_promotion_candidates_from_the_probe_equal_ranking_every_qualifying_row(
    seed: int, gpu_count: int, mixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promotions / prefetches / admissions into free room: the planner checks exactly only the rows whose
    P can reach the k-th best gain of a strided probe; the moves (blocks, actions, values, order) and the
    tried / deferred counts equal those of ranking every qualifying row. Mixed source tiers, admittable
    rows, in-flight and pinned rows; a small room (k = free: no count needed) and a large one (k < free:
    the qualifying rows are counted); mixed block sizes and token counts (the bound is loose) or one
    size (as a deployment's blocks: most rows are never checked)."""
    import kvtier.policies.planner as planner_mod

    rng = np.random.default_rng(seed)
    n = 200_000
    mask = rng.choice(np.array([0, 2, 4, 6, 8], np.uint8), n, p=[0.4, 0.2, 0.25, 0.1, 0.05])
    mask[rng.choice(n, gpu_count, replace=False)] |= 1
    v = BlockView(
        np.arange(1, n + 1, dtype=np.int64),
        mask,
        rng.integers(1, 64, n).astype(np.int32) if mixed else np.full(n, 16, np.int32),
        rng.integers(1 << 14, 1 << 20, n).astype(np.int64) if mixed else np.full(n, 1 << 16, np.int64),
        (rng.random(n) ** 3).astype(np.float32),
        rng.random(n) < 0.3,
    )
    c = PlannerConfig(
        tiers=(
            TierSpec(Tier.GPU, 4000, 0.9, 0.8, load_bandwidth_bytes_s=1e12),
            TierSpec(Tier.CPU, n, load_bandwidth_bytes_s=2e10),
            TierSpec(Tier.DISK, n, load_bandwidth_bytes_s=2e9),
        ),
        default_budget=LinkBudget(bytes_per_s=1e12, ops_per_s=300.0),
    )
    pins = {int(h): Tier.DISK for h in rng.choice(v.hashes, 500, replace=False)}
    up = planner_mod.UpMoves
    used: list[tuple[int, int]] = []
    cands = up.candidates

    def spy(self, rank, k, free, *a):  # type: ignore[no-untyped-def]
        out = cands(self, rank, k, free, *a)
        used.append((self.count(rank), out[0].size))
        return out

    def every_row(self, rank, k, free, *a):  # type: ignore[no-untyped-def]
        rows, src = self.exact(np.arange(len(self.view), dtype=np.intp), rank)
        return rows, src, rows.size

    def plan(p: Planner) -> Plan:
        p.commit([m for m in p.plan(v, 1.0).moves if m.action == "demote"][:50], 1.0)  # some in flight
        return p.plan(v, 2.0, pins=pins)

    monkeypatch.setattr(up, "candidates", spy)
    pruned = plan(Planner(c))
    monkeypatch.setattr(up, "candidates", every_row)
    full = plan(Planner(c))

    assert pruned.moves and used
    assert all(size < (qual if mixed else qual / 3) for qual, size in used)  # the probe did prune
    assert [(m.action, m.block, m.src, m.dst, m.value_s) for m in pruned.moves] == [
        (m.action, m.block, m.src, m.dst, m.value_s) for m in full.moves
    ]
    assert pruned.tried == full.tried and pruned.deferred == full.deferred


@pytest.mark.parametrize("shape", ["random", "clustered", "sparse", "nan", "negative"])
def test_mask_bounds_keep_the_exact_top_k(shape: str) -> None:
    """The mask variants of the value bounds (sampled probe, one cut over P) keep every row of the exact k
    lowest values / k highest gains of the mask, in ascending row order; a mask whose strided sample is too
    thin (one dense run, a few rows) and a P with NaN or negative entries fall back to the row variants."""
    from kvtier.policies.planner import _FIRST_RANK, ValueBounds, _smallest

    rng = np.random.default_rng(len(shape))
    n, k = 120_000, 50
    p = (rng.random(n) ** 2).astype(np.float32)
    mask = rng.random(n) < 0.3
    if shape == "clustered":
        mask[:] = False
        mask[70_000:75_000] = True
    elif shape == "sparse":
        mask = rng.random(n) < 0.003
    elif shape == "nan":
        p[rng.choice(n, 40, replace=False)] = np.nan
    elif shape == "negative":
        p[rng.choice(n, 40, replace=False)] = -0.5
    tier_mask = rng.choice(np.array([0, 2, 4, 6, 8], np.uint8), n)
    v = BlockView(
        np.arange(1, n + 1, dtype=np.int64),
        tier_mask,
        rng.integers(1, 64, n).astype(np.int32),
        rng.integers(1 << 14, 1 << 20, n).astype(np.int64),
        p,
        np.zeros(n, np.bool_),
    )
    bw = np.array([1e12, 2e10, 2e9, 1e9, 1e9])
    vb = ValueBounds(v, bw, 1e-4)

    def value(rows: np.ndarray, rank: int | np.ndarray) -> np.ndarray:
        return p[rows].astype(np.float64) * (v.tokens[rows] * 1e-4 - v.nbytes[rows] / bw[rank])

    every = np.flatnonzero(mask)
    lo = vb.lowest_in_mask(mask, every.size, k, 1, lambda r: value(r, 1))
    assert (np.diff(lo) > 0).all() and np.isin(lo, every).all()
    v_all = value(every, 1)
    assert set(every[_smallest(v_all, k)].tolist()) <= set(lo.tolist())
    slower = np.uint8(~((1 << 2) - 1) & 0xFF)

    def gain(rows: np.ndarray) -> np.ndarray:
        return value(rows, 1) - value(rows, _FIRST_RANK[tier_mask[rows] & slower])

    hi = vb.highest_gain_in_mask(mask, every.size, k, 1, tier_mask, gain)
    assert np.isin(hi, every).all()
    assert set(every[_smallest(-gain(every), k)].tolist()) <= set(hi.tolist())
    if shape == "random":
        assert lo.size < every.size / 3 and hi.size < every.size / 3  # the bounds did cut
