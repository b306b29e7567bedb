"""The simulated cache layer: its default policy (HBM LRU, L1 LRU written through to L2, L2 hits back
through L1), the optional KVBM frequency filter, link accounting, and the moves the memory actuator
applies."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.controller.actuators.base import BlockRef, Outcome
from kvtier.controller.loop import block_key_hex
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier, TierSpec
from kvtier.replay.sim.actuator import MemoryActuator
from kvtier.replay.sim.layer import CacheLayer, LayerBehaviour
from kvtier.replay.sim.report import IndexReporter

BB = 1000  # bytes per block


def _tiers(gpu: int = 2, cpu: int = 3, disk: int = 5) -> list[TierSpec]:
    return [
        TierSpec(Tier.GPU, gpu, load_bandwidth_bytes_s=1e15),
        TierSpec(Tier.CPU, cpu, load_bandwidth_bytes_s=1e6),  # 1 ms per block
        TierSpec(Tier.DISK, disk, load_bandwidth_bytes_s=1e5),  # 10 ms per block
    ]


def _serve(layer: CacheLayer, chain: Sequence[int]) -> list[Tier | None]:
    look = layer.lookup(chain, len(chain) * 10, 10)
    layer.store(chain, look.hit_blocks)
    return look.tiers


def test_default_policy_lru_write_through_and_l2_hits_come_back_through_l1() -> None:
    layer = CacheLayer(_tiers(gpu=2, cpu=4, disk=8), BB)
    assert _serve(layer, [1, 2]) == [None, None]
    assert layer.where(1) is Tier.GPU and 1 in layer.t[Tier.CPU] and 1 in layer.t[Tier.DISK]
    _serve(layer, [3, 4])  # HBM holds 2: 1 and 2 leave HBM (still in L1 and L2)
    assert layer.where(1) is Tier.CPU
    _serve(layer, [5, 6])  # L1 holds 4: 1 and 2 leave L1 (LRU), stay in L2
    assert layer.where(1) is Tier.DISK and layer.where(4) is Tier.CPU
    before = dict(layer.bytes_by_link())
    tiers = _serve(layer, [1, 2, 7])
    assert tiers == [Tier.DISK, Tier.DISK, None]
    after = layer.bytes_by_link()
    assert after["disk->cpu"] - before["disk->cpu"] == 2 * BB  # L2 -> L1 ...
    assert after["cpu->gpu"] - before["cpu->gpu"] == 2 * BB  # ... -> HBM
    assert 1 in layer.t[Tier.CPU] and 2 in layer.t[Tier.CPU]  # kept in L1 on the way up
    assert layer.where(7) is Tier.GPU and layer.resident(Tier.GPU) == 2
    assert layer.hit_tokens["disk"] == 20


def test_prefix_stops_at_the_first_miss_and_hbm_hits_do_not_refresh_l1() -> None:
    layer = CacheLayer(_tiers(gpu=4, cpu=2), BB)
    _serve(layer, [1, 2])
    _serve(layer, [3, 4])  # L1 now {3, 4}; HBM {1, 2, 3, 4}
    assert _serve(layer, [1, 9, 2]) == [Tier.GPU, None, None]  # 2 is cached but past the miss
    assert 1 not in layer.t[Tier.CPU]  # an HBM hit never asked the layer


def test_kvbm_frequency_filter_writes_to_disk_from_the_second_access_on() -> None:
    layer = CacheLayer(_tiers(gpu=1, cpu=1), BB, disk_admission="frequency2")
    _serve(layer, [1])
    assert 1 not in layer.t[Tier.DISK]
    _serve(layer, [2])
    _serve(layer, [3])  # 1 left HBM and L1
    assert layer.where(1) is None
    _serve(layer, [1])
    assert 1 in layer.t[Tier.DISK]


def test_links_are_fifo_so_a_prefetch_delays_a_demand_load() -> None:
    layer = CacheLayer(_tiers(gpu=1, cpu=2, disk=10), BB)
    for b in (1, 2, 3, 4):
        _serve(layer, [b])
    assert layer.where(1) is Tier.DISK and layer.where(2) is Tier.DISK
    layer.now = 100.0
    assert layer.promote(1, Tier.CPU) == ""  # disk->cpu busy 10 ms
    look = layer.lookup([2], 10, 10)  # the demand load queues behind it: 10 + 10 ms, then 1 ms to HBM
    assert look.ready_at == pytest.approx(100.021)
    assert layer.t[Tier.CPU].lru[1] == pytest.approx(100.010)  # the prefetched block is usable then


def test_memory_actuator_applies_moves_and_reports_them_to_the_index() -> None:
    idx = BlockIndex()
    layer = CacheLayer(_tiers(gpu=1, cpu=2), BB, observer=IndexReporter(idx, BB))
    for b in (1, 2, 3):
        _serve(layer, [b])
    act = MemoryActuator(layer)
    assert act.tiers == frozenset({Tier.CPU, Tier.DISK})
    ref = [BlockRef(layer_key=block_key_hex(1))]
    assert layer.where(1) is Tier.DISK
    assert act.promote(ref, Tier.CPU).outcomes[0].outcome is Outcome.APPLIED
    assert idx.count_by_tier()[Tier.CPU] == 2 and 1 in layer.t[Tier.CPU]
    assert act.promote(ref, Tier.CPU).outcomes[0].detail == "already there"
    assert act.evict(ref, Tier.CPU).outcomes[0].outcome is Outcome.APPLIED
    assert 1 not in layer.t[Tier.CPU] and 1 in layer.t[Tier.DISK]
    gone = [BlockRef(layer_key=block_key_hex(99))]
    assert act.evict(gone, Tier.CPU).outcomes[0].outcome is Outcome.SKIPPED
    assert (
        act.demote([BlockRef(layer_key=block_key_hex(3))], Tier.DISK).outcomes[0].outcome is Outcome.APPLIED
    )
    assert 3 not in layer.t[Tier.CPU] and 3 in layer.t[Tier.DISK]
    bad = act.promote([BlockRef(layer_key="zz")], Tier.CPU)
    assert bad.outcomes[0].outcome is Outcome.FAILED
    assert act.applied == {"promote": 1, "evict": 1, "demote": 1}
    # the index agrees with the layer, tier by tier
    for t in (Tier.GPU, Tier.CPU, Tier.DISK):
        assert idx.count_by_tier()[t] == layer.resident(t)


# -- LMCache MP 0.5.6's own details (LayerBehaviour; docs/perf/calibration.md) ------------------------------


def test_layer_lookup_counts_the_whole_prompt_as_lmcache_does() -> None:
    layer = CacheLayer(_tiers(gpu=4, cpu=4, disk=8), BB)
    _serve(layer, [1, 2])
    look = layer.lookup([1, 2, 3], 30, 10)  # HBM has 1 and 2; LMCache is asked from token 0 all the same
    assert look.tiers == [Tier.GPU, Tier.GPU, None]
    assert layer.layer_lookup_tokens == {"cpu": 20}
    assert layer.hit_tokens == {"gpu": 20}


def test_l1_is_credited_only_with_the_prefix_it_serves_when_the_layer_counts_so() -> None:
    """LMCache MP credits L1 with the leading run of the found prefix L1 holds: past a chunk found only in
    L2, an L1-held chunk counts as an L2 hit (what its ``lmcache_mp_lookup_hit_l1_tokens_total`` reports)."""

    def run(prefix_only: bool) -> dict[str, int]:
        bh = LayerBehaviour(l1_hits_prefix_only=prefix_only)
        layer = CacheLayer(_tiers(gpu=1, cpu=8, disk=8), BB, behaviour=bh)
        _serve(layer, [1, 2, 3])
        _serve(layer, [9])  # HBM (one block) now holds 9 only
        layer.evict(2, Tier.CPU)  # 2 is left in L2 only: L1 holds 1 and 3
        before = dict(layer.layer_lookup_tokens)
        assert _serve(layer, [1, 2, 3]) == [Tier.CPU, Tier.DISK, Tier.CPU]  # serving is the same either way
        after = layer.layer_lookup_tokens
        return {t: n - before.get(t, 0) for t, n in after.items() if n != before.get(t, 0)}

    assert run(False) == {"cpu": 20, "disk": 10}
    assert run(True) == {"cpu": 10, "disk": 20}


def test_touch_whole_prompt_keeps_chunks_hbm_served_in_l1() -> None:
    def run(touch: bool) -> bool:
        layer = CacheLayer(_tiers(gpu=4, cpu=4), BB, behaviour=LayerBehaviour(touch_whole_prompt=touch))
        _serve(layer, [1, 2])
        _serve(layer, [3, 4])
        _serve(layer, [1, 2])  # all from HBM; with the touch, 1 and 2 become L1's most recent
        _serve(layer, [5, 6])  # L1 full: evicts its two least recent
        return 1 in layer.t[Tier.CPU]

    assert run(True) and not run(False)


def test_l2_hits_are_not_retained_in_l1_when_the_layer_loads_them_temporarily() -> None:
    layer = CacheLayer(_tiers(gpu=1, cpu=2, disk=8), BB, behaviour=LayerBehaviour(retain_l2_hits=False))
    _serve(layer, [1])
    _serve(layer, [2, 3])  # 1 leaves L1 (LRU), stays in L2
    assert layer.where(1) is Tier.DISK
    before = layer.bytes_by_link()["disk->cpu"]
    assert _serve(layer, [1]) == [Tier.DISK]
    assert layer.bytes_by_link()["disk->cpu"] - before == BB  # loaded through L1 ...
    assert 1 not in layer.t[Tier.CPU]  # ... but not kept there


def test_tail_first_evicts_a_chains_tail_before_its_head() -> None:
    layer = CacheLayer(_tiers(gpu=3, cpu=8), BB, behaviour=LayerBehaviour(tail_first=True))
    _serve(layer, [1, 2, 3])
    _serve(layer, [4])  # HBM holds 3: the tail (3) goes, the head stays
    assert layer.where(1) is Tier.GPU and layer.where(3) is Tier.CPU


def test_watermark_loop_trims_l1_periodically_and_a_full_l1_refuses_a_store() -> None:
    bh = LayerBehaviour(l1_watermark=0.8, l1_eviction_ratio=0.2, l1_eviction_interval_s=1.0)
    layer = CacheLayer(_tiers(gpu=1, cpu=10, disk=100), BB, behaviour=bh)
    _serve(layer, list(range(1, 9)))  # 8 of 10: at the watermark, but the loop has not run yet
    assert layer.resident(Tier.CPU) == 8
    layer.now = 1.0
    _serve(layer, [20])  # the loop runs first: evicts int(8 x 0.2) = 1, then the store adds one
    assert layer.resident(Tier.CPU) == 8 and layer.evictions["cpu"] == 1
    _serve(layer, [30, 31, 32])  # 8 + 3 > 10: the whole store is refused, from L1 and from L2
    assert layer.store_failures == 3 and 30 not in layer.t[Tier.CPU] and 30 not in layer.t[Tier.DISK]
    layer.now = 5.5  # idle periods: one trim (8 -> 7 is below the watermark), then nothing until now
    _serve(layer, [40])
    assert layer.evictions["cpu"] == 2 and layer.resident(Tier.CPU) == 8


def test_l2_hits_need_l1_staging_room_all_or_nothing() -> None:
    """LMCache reserves the L2 hits' L1 staging buffers in one allocation: with fewer free L1 slots than L2
    hits the found prefix ends at the first L2 hit (and the engine gets no more than that beyond HBM)."""

    def run(stage: bool) -> tuple[list[Tier | None], int]:
        bh = LayerBehaviour(l1_watermark=0.8, l2_loads_stage_in_l1=stage, retain_l2_hits=False)
        layer = CacheLayer(_tiers(gpu=1, cpu=10, disk=100), BB, behaviour=bh, l1_loop_first_s=100.0)
        _serve(layer, [1, 2, 3])
        for b in range(10, 17):
            _serve(layer, [b])  # L1 full: 10 of 10 (the loop does not run before t = 100 s)
        layer.evict(2, Tier.CPU)  # 2 and 3 now only in L2: two staging slots needed ...
        layer.evict(3, Tier.CPU)
        _serve(layer, [99])  # ... and one is free
        return _serve(layer, [1, 2, 3, 4]), layer.l2_staging_failures

    assert run(False) == ([Tier.CPU, Tier.DISK, Tier.DISK, None], 0)
    assert run(True) == ([Tier.CPU, None, None, None], 2)


def test_a_promote_into_a_full_watermarked_l1_is_refused_and_lookups_go_on() -> None:
    """A copy into L1 allocates there as a store does: at capacity (before the loop trims) it fails, so L1
    never holds more than its capacity, and the staging check of the next lookup sees no negative room."""
    bh = LayerBehaviour(l1_watermark=0.8, l2_loads_stage_in_l1=True, retain_l2_hits=False)
    layer = CacheLayer(_tiers(gpu=1, cpu=10, disk=100), BB, behaviour=bh, l1_loop_first_s=100.0)
    _serve(layer, [1, 2])
    layer.evict(2, Tier.CPU)
    for b in range(10, 19):
        _serve(layer, [b])  # L1 full: 10 of 10
    assert layer.promote(2, Tier.CPU) == "tier full" and layer.resident(Tier.CPU) == 10
    assert _serve(layer, [1, 2]) == [Tier.CPU, None]  # 2 is in L2, no L1 room to stage it


def test_the_l1_loop_runs_at_the_given_phase() -> None:
    bh = LayerBehaviour(l1_watermark=0.8, l1_eviction_ratio=0.5, l1_eviction_interval_s=1.0)
    for first, trimmed in ((0.3, 4), (None, 0)):
        layer = CacheLayer(_tiers(gpu=1, cpu=10, disk=100), BB, behaviour=bh, l1_loop_first_s=first)
        _serve(layer, list(range(1, 10)))  # 9 of 10, above the watermark
        layer.now = 0.5
        _serve(layer, [50])
        assert layer.evictions["cpu"] == trimmed  # int(9 x 0.5) when the loop ran at 0.3 s


def test_the_l1_loop_follows_an_observed_schedule_then_keeps_its_interval() -> None:
    """Observed run times (LMCache's log) replace the periodic phase: a late run (1.7 s, not 1.0 s) trims
    after a store at 1.5 s, not before it; after the schedule the loop goes on at its interval."""
    bh = LayerBehaviour(l1_watermark=0.8, l1_eviction_ratio=0.5, l1_eviction_interval_s=1.0)
    layer = CacheLayer(_tiers(gpu=1, cpu=10, disk=100), BB, behaviour=bh, l1_loop_first_s=1.0,
                       l1_loop_times_s=[-0.3, 0.7, 1.7])  # fmt: skip
    _serve(layer, list(range(1, 10)))  # 9 of 10 at t = 0
    layer.now = 0.8
    _serve(layer, [50])  # the run at 0.7 s trimmed int(9 x 0.5) = 4 first: 5 + 1
    assert layer.evictions["cpu"] == 4 and layer.resident(Tier.CPU) == 6
    _serve(layer, [51, 52])  # 8: at the watermark
    layer.now = 1.5
    _serve(layer, [53, 54])  # the periodic phase would have trimmed at 1.0 s; the observed run is at 1.7 s
    assert layer.evictions["cpu"] == 4 and layer.resident(Tier.CPU) == 10
    layer.now = 2.0
    _serve(layer, [60])  # the run at 1.7 s: int(10 x 0.5) = 5 go, then the store
    assert layer.evictions["cpu"] == 9 and layer.resident(Tier.CPU) == 6
    for b in range(70, 74):
        _serve(layer, [b])  # 10 of 10
    layer.now = 2.75  # the schedule is spent: the next run is one interval on, at 2.7 s
    _serve(layer, [80])
    assert layer.evictions["cpu"] == 14
