"""Bulk index updates (policies/index_bulk.py) give the same index as the one-by-one BlockIndex calls for
vLLM-shaped operation streams (parents stored before children, time non-decreasing)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.policies.index import BlockIndex
from kvtier.policies.index_bulk import (
    REMOVE,
    STORE,
    TOUCH,
    TOUCH_CHAIN,
    OpQueue,
    _slow,
    apply_ops,
    stable_argsort,
)


def stream(seed: int, n_req: int = 300) -> OpQueue:
    rng = random.Random(seed)
    q = OpQueue()
    chains: list[list[int]] = []
    resident: dict[int, int] = {}  # key -> tier rank
    t = 0.0

    def add(op: int, k: int, p: int | None, r: int) -> None:
        q.ops.append((op, k, p, r, t))

    for _ in range(n_req):
        t += rng.random() * 10
        r = rng.choice([0, 0, 0, 1, 2])
        if chains and rng.random() < 0.5:  # extend or re-use an existing prefix
            base = rng.choice(chains)
            cut = rng.randrange(1, len(base) + 1)
            parent = base[cut - 1]
            add(TOUCH_CHAIN, parent, None, r)
            for k in base[:cut]:
                if rng.random() < 0.2:
                    add(TOUCH, k, None, r)
            new = [rng.getrandbits(64) for _ in range(rng.randrange(1, 6))]
            chain = base[:cut] + new
        else:
            parent, new = None, [rng.getrandbits(64) for _ in range(rng.randrange(1, 8))]
            chain = new
        p = parent
        for k in new:
            add(STORE, k, p, r)
            resident[k] = r
            p = k
        chains.append(chain)
        for k in list(resident)[: max(0, len(resident) - 150)]:
            add(REMOVE, k, None, resident.pop(k))
        if rng.random() < 0.1 and resident:  # re-store a removed-or-resident block in another tier
            k = rng.choice(list(resident))
            add(STORE, k, None, (resident[k] + 1) % 4)
    return q


def copy_q(q: OpQueue) -> OpQueue:
    c = OpQueue()
    c.ops = list(q.ops)
    return c


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("window", [7, 100, 10_000])
def test_bulk_equals_one_by_one(seed: int, window: int) -> None:
    q = stream(seed)
    a, b = BlockIndex(initial_capacity=16), BlockIndex(initial_capacity=16)
    _slow(a, copy_q(q))
    for i in range(0, len(q), window):
        part = OpQueue()
        sl = slice(i, i + window)
        part.ops = q.ops[sl]
        apply_ops(b, part)
        assert len(part) == 0
    assert len(a) == len(b)
    assert a.count_by_tier() == b.count_by_tier()
    for k in {o[1] for o in q.ops}:
        sa, sb = a.get(k), b.get(k)
        assert (sa is None) == (sb is None)
        if sa is None or sb is None:
            continue
        assert sa.tiers == sb.tiers and sa.parent == sb.parent and sa.depth == sb.depth
        assert sa.frequency == sb.frequency and sa.last_access_ms == sb.last_access_ms
        assert sa.children == sb.children and sa.resident_children == sb.resident_children
        assert sa.first_seen_ms == sb.first_seen_ms
        np.testing.assert_allclose(sa.gap_ewma_ms, sb.gap_ewma_ms, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    "n, distinct", [(0, 1), (1, 1), (2, 1), (50, 3), (5000, 40), (20_000, 19_000), (9, 9)]
)
def test_stable_argsort_equals_numpys_stable_sort(n: int, distinct: int) -> None:
    """Few distinct values (long tie runs), mostly distinct ones, extremes of int64, no ties at all."""
    rng = np.random.default_rng(n)
    vals = rng.integers(-(2**63), 2**63 - 1, size=distinct, dtype=np.int64)
    vals[: min(2, distinct)] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max][: min(2, distinct)]
    x = vals[rng.integers(0, distinct, size=n)] if distinct < n else rng.permutation(vals)[:n]
    assert stable_argsort(x).tolist() == np.argsort(x, kind="stable").tolist()
