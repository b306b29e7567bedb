"""``SlotARC`` (ARC over dense slots, the learned policy's ARC expert) decides exactly like ``ARCPolicy``."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.arc import ARCPolicy, SlotARC
from kvtier.policies.base import Request
from kvtier.replay.synthetic import multiturn_trace
from kvtier.replay.trace import bundled_trace_path, load_trace


def _trace(name: str) -> list[Request]:
    if name == "conversation":
        return load_trace(bundled_trace_path())[:3000]
    return multiturn_trace(2500, seed=3, think_s=10.0, sessions_per_s=4.0)


@pytest.mark.parametrize(
    ("name", "cap"),
    [
        ("conversation", 0),
        ("conversation", 1),
        ("conversation", 500),
        ("conversation", 5000),
        ("multiturn", 7),
        ("multiturn", 50),
        ("multiturn", 500),
    ],
)
def test_slot_arc_matches_arc_hit_for_hit_and_eviction_for_eviction(name: str, cap: int) -> None:
    """Every request's hit mask, every evicted block (in order) and the size agree, and so do the resident
    sets at the end. The multiturn runs hit both ghost lists (B1 and B2), so all four branches run."""
    slot: dict[int, int] = {}
    ref, arc = ARCPolicy(cap), SlotARC(cap, 4)  # starts small: exercises grow()
    before = np.zeros(5, np.int64)  # list id of each accessed slot just before its request
    for r in _trace(name):
        ids = r.hash_ids.tolist()
        for b in ids:
            slot.setdefault(b, len(slot))
        arc.grow(len(slot))
        sl = [slot[b] for b in ids]
        np.add.at(before, arc.where[sl], 1)
        ev: list[int] = []
        h = arc.access(sl, ev)
        assert ref.access(r).tolist() == h
        assert [slot[b] for b in ref.drain_evicted()] == ev
        assert len(ref) == len(arc)
    inv = {s: b for b, s in slot.items()}
    held = np.flatnonzero((arc.where == 1) | (arc.where == 2)).tolist()
    assert {inv[s] for s in held} == {b for b in slot if ref.contains(b)}
    if name == "multiturn":
        assert before[3] > 0 and before[4] > 0  # ghost hits in B1 and in B2


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc"])
def test_slot_experts_decide_like_the_registry_policy_on_block_ids(name: str) -> None:
    """``make_expert`` (ARC natively on slots, others fed the slots as ids) gives the hits of the registry
    policy run on the block ids, and reports exactly its evictions (as slots)."""
    from kvtier.policies.registry import get_policy
    from kvtier.policies.slot_expert import make_expert

    slot: dict[int, int] = {}
    cap = 300
    ref, ex = get_policy(name, cap, 0), make_expert(name, cap, 0, 8)
    for r in _trace("multiturn")[:1500]:
        ids = r.hash_ids.tolist()
        for b in ids:
            slot.setdefault(b, len(slot))
        ex.grow(len(slot))
        h, ev = ex.serve(r, np.array([slot[b] for b in ids], dtype=np.int64))
        assert ref.access(r).tolist() == h.tolist()
        assert [slot[b] for b in ref.drain_evicted()] == list(ev)
