"""``SlotLog`` (the index's change log for incremental readers) against a reference deque of every change."""

from __future__ import annotations

import gc
import random
from collections import deque

import numpy as np

from kvtier.policies.index import SlotLog


def test_since_matches_a_reference_through_adds_extends_and_overflow() -> None:
    rng = random.Random(5)
    size = 300
    log = SlotLog(size)
    ref: deque[tuple[int, int]] = deque()  # (version before the change, slot), the last `size`
    readers = [0, 0, 0]
    for _ in range(3000):
        r = rng.random()
        if r < 0.6:
            s = rng.randrange(10**6)
            ref.append((log.version, s))
            log.add(s)
        elif r < 0.95:
            k = rng.choice([0, 1, 5, 40, 299, 300])
            slots = np.array([rng.randrange(10**6) for _ in range(k)], np.intp)
            for j, s in enumerate(slots.tolist()):
                ref.append((log.version + j, s))
            log.extend(slots)
        else:  # more than the log holds: every reader must refresh everything
            log.extend(np.arange(size + 1, dtype=np.intp))
            ref.clear()
        while len(ref) > size:
            ref.popleft()
        for i, v in enumerate(readers):
            got = log.since(v)
            want = [s for ver, s in ref if ver >= v]
            if v < log.version - len(ref) or (not ref and v < log.version):
                assert got is None
            else:
                assert got is not None and got.tolist() == want
            if rng.random() < 0.3:
                readers[i] = log.version
    assert log.since(log.version + 1) is None


def test_a_full_log_holds_no_int_objects_for_the_gc() -> None:
    log = SlotLog(65_536)
    for s in range(200_000, 300_000):
        log.add(s)
    log.since(log.version - 10)
    seen: set[int] = set()
    frontier: list[object] = [log]
    visits = 0  # what a GC traversal from the log visits, 3 levels deep
    for _ in range(3):
        nxt: list[object] = []
        for o in frontier:
            refs = gc.get_referents(o)
            visits += len(refs)
            nxt += [r for r in refs if gc.is_tracked(r) and id(r) not in seen and not isinstance(r, type)]
            seen.update(id(r) for r in refs)
        frontier = nxt
    assert visits < 5_000  # (a deque of 65k ints: > 65k)
