"""Whole-trace checks on the bundled Mooncake conversation trace: libCacheSim (real third-party simulator)
agreement for lru/fifo, Belady as upper bound, and the reference figures of trace_baselines.md."""

from __future__ import annotations

import functools

import libcachesim as lcs
import numpy as np
import pytest

from kvtier.policies.registry import CLASSIC, get_policy
from kvtier.replay.engine import ReplayStats, prefix_tokens, replay
from kvtier.replay.trace import bundled_trace_path, distinct_blocks, load_trace

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
# shared/reference/trace_baselines.md §4 (conversation), % : (prefix hit, block hit)
REFERENCE = {
    "lru": [(5.3, 5.2), (8.0, 7.9), (19.9, 19.5), (28.4, 27.8), (35.1, 34.5), (36.7, 36.0)],
    "fifo": [(5.1, 5.0), (7.7, 7.6), (17.8, 18.0), (25.3, 25.6), (31.9, 32.1), (35.4, 35.2)],
    "belady": [(25.1, 24.6), (32.0, 31.4), (37.4, 36.6), (37.4, 36.6), (37.4, 36.6), (37.4, 36.6)],
}


@functools.cache
def trace() -> tuple:
    reqs = load_trace(bundled_trace_path())
    return tuple(reqs), distinct_blocks(reqs)


@functools.cache
def result(policy: str, frac: float) -> ReplayStats:
    reqs, d = trace()
    return replay(list(reqs), get_policy(policy, round(frac * d)))


def test_trace_shape() -> None:
    reqs, d = trace()
    assert len(reqs) == 12031 and d == 182790
    assert sum(len(r.hash_ids) for r in reqs) == 288500


def libcachesim_run(cls: type, cap: int) -> tuple[int, int, int]:
    """Feed the block access sequence (unit-size objects) to libCacheSim; -> hits, prefix tokens, inputs."""
    reqs, _ = trace()
    cache = cls(cap)
    hits = tok = tok_in = 0
    r = lcs.Request()
    r.obj_size = 1
    vt = 0
    for q in reqs:
        mask = []
        for b in q.hash_ids.tolist():
            r.obj_id = b
            r.clock_time = vt
            vt += 1
            mask.append(cache.get(r))
        m = np.asarray(mask)
        hits += int(m.sum())
        lead = len(m) if m.all() else int(np.argmin(m))
        tok += prefix_tokens(q, lead)
        tok_in += q.input_length
    return hits, tok, tok_in


@pytest.mark.parametrize("frac", FRACTIONS)
@pytest.mark.parametrize(("policy", "cls"), [("lru", lcs.LRU), ("fifo", lcs.FIFO), ("arc", lcs.ARC)])
def test_equals_libcachesim(policy: str, cls: type, frac: float) -> None:
    _, d = trace()
    ours = result(policy, frac)
    hits, tok, tok_in = libcachesim_run(cls, round(frac * d))
    assert ours.block_hits == hits, f"{policy}@{frac}: ours {ours.block_hits} vs libCacheSim {hits}"
    assert ours.prefix_hit_tokens == tok and ours.input_tokens == tok_in


@pytest.mark.parametrize("frac", FRACTIONS)
def test_belady_is_upper_bound(frac: float) -> None:
    bel = result("belady", frac)
    for p in CLASSIC:
        other = result(p, frac)
        assert bel.block_hit_ratio >= other.block_hit_ratio, p
        assert bel.prefix_hit_ratio >= other.prefix_hit_ratio, p


@pytest.mark.parametrize("policy", sorted(REFERENCE))
def test_matches_reference(policy: str) -> None:
    for frac, (ref_pfx, ref_blk) in zip(FRACTIONS, REFERENCE[policy], strict=True):
        s = result(policy, frac)
        assert abs(100 * s.prefix_hit_ratio - ref_pfx) <= 0.2 + 0.05, (policy, frac, s.prefix_hit_ratio)
        assert abs(100 * s.block_hit_ratio - ref_blk) <= 0.2 + 0.05, (policy, frac, s.block_hit_ratio)
