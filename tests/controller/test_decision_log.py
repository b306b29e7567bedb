"""DecisionLog: the ring of decision objects and the columnar pending queue, against a plain reference (a
deque of every decision, scanned the way the log used to)."""

from __future__ import annotations

import random
from collections import deque

from kvtier.controller.decisions import Decision, DecisionLog, score

ACTIONS = ("promote", "demote", "evict", "admit", "prefetch", "pin")


def mk(i: int, at: float, rng: random.Random) -> Decision:
    return Decision(
        i, i // 7, at, rng.choice(ACTIONS), rng.randrange(-(2**63), 2**63), "gpu", "cpu", 0.1, 0.5, False,
        "shadow", tokens=rng.randrange(0, 10_000), freq0=rng.randrange(-1, 50),
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
            want = []
            for d in ref:
                if d.at_s > before or len(want) >= limit:
                    break
                want.append(d)
            got = log.due(before, limit)
            assert [(d.id, d.at_s, d.block, d.action, d.freq0, d.tokens) for d in got] == [
                (d.id, d.at_s, d.block, d.action, d.freq0, d.tokens) for d in want
            ]
            ring = {d.id for d in log}
            # the ring's own objects are handed out (scoring shows in /v1/decisions), the rest are bare
            assert all((d is w) == (d.id in ring) for d, w in zip(got, want, strict=True))
            if rng.random() < 0.3 and len(got) > 2:  # an arbitrary subset, not the oldest prefix
                got = got[1::2]
            for d in got:
                score(d, d.freq0 + rng.randrange(0, 2), t + 1e6, 1.0)
            log.mark_scored(got)
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
    assert len(due) == 10 and due[-1] is ds[-1] and due[0] is not ds[0]
    for d in due:
        score(d, d.freq0 + 1, 10.0, 1.0)
    log.mark_scored(due)
    rep = log.report
    assert rep.scored == 10 and rep.upward == 10
    back = [d for d in ds if d.freq0 >= 0]
    assert rep.hits_gained == len(back) and rep.tokens_gained == sum(d.tokens for d in back)
    assert ds[-1].came_back is (ds[-1].freq0 >= 0) and ds[-1].scored_at_s == 10.0  # the ring's object scored
    assert log.n_pending == 0 and log.due(100.0, 10) == []
