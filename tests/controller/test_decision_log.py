"""DecisionLog: the ring of decision objects and the columnar pending queue, against a plain reference (a
deque of every decision, scanned the way the log used to)."""

from __future__ import annotations

import gc
import random
import types
from collections import deque

from kvtier.controller.actuators.base import Outcome
from kvtier.controller.decisions import Decision, DecisionLog, score

ACTIONS = ("promote", "demote", "evict", "admit", "prefetch", "pin")


def mk(i: int, at: float, rng: random.Random) -> Decision:
    return Decision(
        i,
        i // 7,
        at,
        rng.choice(ACTIONS),
        rng.randrange(-(2**63), 2**63),
        "gpu",
        "cpu",
        0.1,
        0.5,
        False,
        "shadow",
        tokens=rng.randrange(0, 10_000),
        freq0=rng.randrange(-1, 50),
    )


def test_pending_queue_matches_a_reference_through_adds_scoring_and_drops() -> None:
    rng = random.Random(7)
    log = DecisionLog(max_len=50, max_pending=300)
    ref: deque[Decision] = deque()
    dropped = 0
    t, nid = 0.0, 1
    for step in range(400):
        batch = [mk(nid + j, t, rng) for j in range(rng.randrange(0, 12))]
        nid += len(batch)
        if len(batch) == 1 and rng.random() < 0.5:
            log.add(batch[0])
        else:
            log.add_many(batch)
        ref.extend(batch)
        while len(ref) > 300:
            ref.popleft()
            dropped += 1
        t += 1.0
        if step % 5 == 0:
            before, limit = t - rng.uniform(0, 40), rng.randrange(1, 60)
            want: list[Decision] = []
            for d in ref:
                if d.at_s > before or len(want) >= limit:
                    break
                want.append(d)
            got = log.due(before, limit)
            assert [(d.id, d.at_s, d.block, d.action, d.freq0, d.tokens) for d in got] == [
                (d.id, d.at_s, d.block, d.action, d.freq0, d.tokens) for d in want
            ]
            if rng.random() < 0.3 and len(got) > 2:  # an arbitrary subset, not the oldest prefix
                got = got[1::2]
            for d in got:
                score(d, d.freq0 + rng.randrange(0, 2), t + 1e6, 1.0)
            log.mark_scored(got)
            shown = {d.id: d for d in log}  # the ring shows the scores (what /v1/decisions serves)
            for d in got:
                if d.id in shown:
                    assert (shown[d.id].came_back, shown[d.id].score) == (d.came_back, d.score)
            done = {d.id for d in got}
            ref = deque(d for d in ref if d.id not in done)
        assert [d.id for d in log.pending()] == [d.id for d in ref]
        assert log.n_pending == len(ref) and log.report.unscored_dropped == dropped
        assert len(log) == min(50, nid - 1)
    assert dropped > 0 and log.report.scored > 0


def test_scored_out_of_ring_decisions_count_in_the_report() -> None:
    rng = random.Random(1)
    log = DecisionLog(max_len=2, max_pending=100)
    ds = [mk(i, 0.0, rng) for i in range(1, 11)]
    for d in ds:
        d.action = "promote"
    log.add_many(ds)
    assert len(log) == 2 and log.n_pending == 10
    due = log.due(1.0, 100)
    assert [d.id for d in due] == [d.id for d in ds]
    for d in due:
        score(d, d.freq0 + 1, 10.0, 1.0)
    log.mark_scored(due)
    rep = log.report
    assert rep.scored == 10 and rep.upward == 10
    back = [d for d in ds if d.freq0 >= 0]
    assert rep.hits_gained == len(back) and rep.tokens_gained == sum(d.tokens for d in back)
    shown = log.query(1)[0]  # the ring shows the newest one's score
    assert shown.id == ds[-1].id and shown.came_back is (ds[-1].freq0 >= 0) and shown.scored_at_s == 10.0
    assert log.n_pending == 0 and log.due(100.0, 10) == []


def test_ring_returns_what_went_in_newest_first_filtered_like_a_list() -> None:
    rng = random.Random(11)
    log = DecisionLog(max_len=64, max_pending=1000)
    every: list[Decision] = []
    for i in range(1, 300):
        d = mk(i, float(i), rng)
        d.outcome = Outcome(rng.choice(["shadow", "applied", "failed", "skipped"]))
        d.detail = rng.choice(["", "no outcome for key", f"HTTP {i}"])
        d.src = rng.choice([None, "disk", "cpu"])
        d.pinned = rng.random() < 0.2
        every.append(d)
    for j in range(0, len(every), 7):  # batches and singles
        if j % 2:
            log.add_many(every[j : j + 7])
        else:
            for d in every[j : j + 7]:
                log.add(d)
    kept = every[-64:]
    assert len(log) == 64 and [d.to_dict() for d in log] == [d.to_dict() for d in kept]
    cases = [(None, None, 100), ("evict", None, 5), (None, "failed", 100), ("x", None, 9)]
    for action, outcome, limit in cases:
        want = [d for d in reversed(kept) if action in (None, d.action) and outcome in (None, d.outcome)]
        got = log.query(limit, action=action, outcome=outcome)
        assert [d.to_dict() for d in got] == [d.to_dict() for d in want[:limit]]
    b = kept[10].block
    assert [d.id for d in log.query(10, block=b)] == [d.id for d in reversed(kept) if d.block == b]


def test_a_full_ring_adds_no_objects_for_the_cyclic_gc() -> None:
    """The ring holds 20k decisions without 20k GC-tracked objects (their full collections, every ~20
    ticks, cost 15-30 ms inside a tick when they were objects)."""
    rng = random.Random(3)
    log = DecisionLog(max_len=20_000)
    ds = [mk(i, float(i), rng) for i in range(1, 20_001)]
    log.add_many(ds)
    assert len(log) == 20_000
    assert _gc_tracked_reachable(ds) >= 20_000  # the yardstick: the same decisions as objects
    del ds
    assert _gc_tracked_reachable(log) < 100  # what a full collection traverses from the log itself


def _gc_tracked_reachable(root: object, limit: int = 100_000) -> int:
    """GC-tracked objects reachable from ``root`` (not counting classes, modules and functions, which the
    collector traverses once for the whole program), up to ``limit``."""
    shared = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, frontier, n = {id(root)}, [root], 0
    while frontier and n <= limit:
        nxt: list[object] = []
        for o in frontier:
            for r in gc.get_referents(o):
                if id(r) not in seen and gc.is_tracked(r) and not isinstance(r, shared):
                    seen.add(id(r))
                    nxt.append(r)
        n += len(nxt)
        frontier = nxt
    return n
