"""Second-sight admission and its guard (pure): wins where most chunks are used once, trips where not."""

from __future__ import annotations

from kvtier.policies.l1_admission import AdmissionCore


def _scan_plus_hot(core: AdmissionCore, n: int) -> None:
    """Each request: 4 hot chunks (2 groups alternating: 8 hot in all) + 12 never-seen-again chunks."""
    u = 10_000
    for i in range(n):
        hot = [i % 2 * 4 + j for j in range(4)]
        scan = list(range(u, u + 12))
        u += 12
        core.observe(hot + scan)


def test_admission_beats_lru_when_most_chunks_are_used_once() -> None:
    c = AdmissionCore(24, window=256)
    _scan_plus_hot(c, 400)
    assert c.total_admission_hits > 1.5 * c.total_default_hits
    assert c.acting and c.trips == 0


def test_first_sight_chunks_are_dropped_second_sight_kept() -> None:
    c = AdmissionCore(10)
    assert c.observe(["a", "b"]) == ["a", "b"]
    assert c.observe(["a", "c"]) == ["c"]


def test_guard_trips_when_every_chunk_comes_back_exactly_once_and_resumes() -> None:
    c = AdmissionCore(64, window=128)
    base = 0
    for i in range(200):  # prompt i, then prompt i-4 again: LRU hits all repeats, admission none
        c.observe(list(range(base + i * 8, base + i * 8 + 8)))
        if i >= 4:
            c.observe(list(range(base + (i - 4) * 8, base + (i - 4) * 8 + 8)))
    assert c.trips == 1 and not c.acting
    assert c.observe(list(range(10**6, 10**6 + 4))) == []  # held in shadow: nothing to drop
    assert "harmful" in [w.verdict for w in c.windows]
    c.set_capacity(24)
    _scan_plus_hot(c, 400)  # the workload changes: admission would pay again
    assert c.resumes >= 1 and c.acting


def test_capacity_follows_the_layer() -> None:
    c = AdmissionCore(100)
    c.set_capacity(3)
    c.observe([1, 2, 3, 4, 1, 2, 3, 4])
    assert c.total_default_hits == 0  # LRU of 3 over a cycle of 4 never hits
