"""SlotMap (numpy open-addressing int64 -> int64 map) against a dict on seeded random operations, and
LogitCache invalidation. Pure unit tests."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.slotmap import EMPTY, MAX_LOAD, LogitCache, SlotMap

_I64 = np.iinfo(np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_slotmap_matches_a_dict_on_random_operations(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sm, d = SlotMap(16), {}
    # a small key pool so keys collide, repeat and get deleted; edge values included
    pool = rng.integers(_I64.min + 1, _I64.max, size=400, dtype=np.int64)
    pool[:6] = [0, -1, 1, _I64.max, _I64.min, 1 << 40]
    for _ in range(2500):
        op = int(rng.integers(0, 7))
        k = int(pool[rng.integers(0, pool.size)])
        if op == 0:
            v = int(rng.integers(-5, 1000))
            sm.put(k, v)
            d[k] = v
        elif op == 1:
            assert sm.pop(k, -7) == d.pop(k, -7)
        elif op == 2:
            assert sm.get(k, -9) == d.get(k, -9)
            assert (k in sm) == (k in d)
            if k in d:
                assert sm[k] == d[k]
            else:
                with pytest.raises(KeyError):
                    sm[k]
        elif op == 3:  # batched puts, small (scalar path) or large (vectorised), repeated keys: last wins
            size = int(rng.choice([5, 40, 300, 700]))
            ks = pool[rng.integers(0, pool.size, size=size)]
            vs = rng.integers(0, 100, size=size)
            sm.put_many(ks, vs)
            d.update(zip(ks.tolist(), vs.tolist(), strict=True))
        elif op == 4:
            size = int(rng.choice([3, 30, 300, 900]))
            ks = pool[rng.integers(0, pool.size, size=size)]
            assert sm.get_many(ks, -3).tolist() == [d.get(a, -3) for a in ks.tolist()]
            assert sm.get_list(ks.tolist(), -4) == [d.get(a, -4) for a in ks.tolist()]
        elif op == 5:
            ks = pool[rng.integers(0, pool.size, size=int(rng.integers(0, 20)))].tolist()
            vs = rng.integers(0, 50, size=len(ks)).tolist()
            sm.put_list(ks, vs)
            d.update(zip(ks, vs, strict=True))
        else:  # get_or_assign: setdefault with a counter, repeats find the value just given
            ks = pool[rng.integers(0, pool.size, size=int(rng.integers(0, 40)))].tolist()
            first = int(rng.integers(1000, 2000))
            nxt, want = first, []
            for a in ks:
                if a not in d:
                    d[a] = nxt
                    nxt += 1
                want.append(d[a])
            assert sm.get_or_assign(ks, first) == (want, nxt - first)
        assert len(sm) == len(d)
    keys, vals = sm.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == d
    sm.clear()
    assert len(sm) == 0 and sm.get(int(pool[0])) == -1


def test_slotmap_grows_and_stays_compact() -> None:
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(_I64.min, _I64.max, size=200_000, dtype=np.int64))
    sm = SlotMap()
    sm.put_many(keys, np.arange(keys.size))
    assert len(sm) == keys.size
    q = rng.permutation(keys)[:50_000]
    assert (keys[sm.get_many(q)] == q).all()
    absent = rng.integers(_I64.min, _I64.max, size=1000, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    assert (sm.get_many(absent) == -1).all()
    # at most 2 buckets of 16 bytes per entry after growth... plus the power-of-two rounding
    assert sm.nbytes <= 4 * 16 * keys.size
    for k in q[:2000].tolist():  # deletions keep the other keys reachable (backward shift)
        assert sm.pop(k) >= 0
    rest = np.setdiff1d(keys, q[:2000])
    assert (keys[sm.get_many(rest)] == rest).all()
    assert (sm.get_many(q[:2000]) == -1).all()


def test_slotmap_rejects_its_sentinel_value() -> None:
    sm = SlotMap()
    with pytest.raises(ValueError):
        sm.put(1, int(EMPTY))
    with pytest.raises(ValueError):
        sm.put_many(np.arange(300), np.full(300, EMPTY))


def test_logit_cache_recomputes_only_changed_events_and_versions() -> None:
    calls: list[list[int]] = []

    def compute(ev: np.ndarray) -> np.ndarray:
        calls.append(ev.tolist())
        return ev.astype(np.float64) * 10.0

    c = LogitCache()
    slots = np.array([0, 5, 2000])
    assert c.get(slots, np.array([1, 2, 3]), "v1", compute).tolist() == [10.0, 20.0, 30.0]
    assert c.get(slots, np.array([1, 2, 3]), "v1", compute).tolist() == [10.0, 20.0, 30.0]
    assert calls == [[1, 2, 3]]  # second lookup: all cached
    assert c.get(slots, np.array([1, 9, 3]), "v1", compute).tolist() == [10.0, 90.0, 30.0]
    assert calls[-1] == [9]  # only the slot with a new access event
    assert c.get(slots, np.array([1, 9, 3]), "v2", compute).tolist() == [10.0, 90.0, 30.0]
    assert calls[-1] == [1, 9, 3]  # a new model version invalidates everything


def test_logit_cache_warm_fills_stale_entries_ahead_of_lookups() -> None:
    calls: list[list[int]] = []

    def compute(ev: np.ndarray) -> np.ndarray:
        calls.append(ev.tolist())
        return ev.astype(np.float64) + 0.5

    c = LogitCache()
    slots, ev = np.array([3, 1, 7]), np.array([30, 10, 70])
    assert c.warm(slots, ev, 1, compute) == 3
    assert c.warm(slots, ev, 1, compute) == 0  # nothing stale
    assert c.get(slots, ev, 1, compute).tolist() == [30.5, 10.5, 70.5]
    assert calls == [[30, 10, 70]]  # the lookup was served from the warmed entries
    assert c.warm(slots, ev, 2, compute) == 3  # a new version: all stale again


def test_logit_cache_remap_rescales_live_entries_and_drops_the_rest() -> None:
    calls: list[list[int]] = []

    def compute(ev: np.ndarray) -> np.ndarray:
        calls.append(ev.tolist())
        return ev.astype(np.float64)

    c = LogitCache()
    slots, ev = np.array([3, 1, 7]), np.array([30, 10, 70])
    c.warm(slots, ev, "v", compute)
    assert c.remap("other", 0, lambda k, e: k * 0.0) == 0  # another version: nothing to keep, nothing changed
    assert c.get(slots, ev, "v", compute).tolist() == [30.0, 10.0, 70.0]
    assert c.remap("v", 20, lambda k, e: k + e / 10.0) == 2  # events >= 20 kept (rescaled), event 10 dropped
    assert c.get(slots, ev, "v", compute).tolist() == [33.0, 10.0, 77.0]
    assert calls == [[30, 10, 70], [10]]  # only the dropped entry was computed again


@pytest.mark.parametrize("clustered", [False, True])
def test_bulk_inserts_of_absent_keys_equal_a_dict_through_growth(clustered: bool) -> None:
    """Batches of distinct absent keys (incl. keys that share home buckets, so probe runs are long and the
    scalar tail runs) through several rehashes: every key maps to its value, absent keys stay absent."""
    rng = np.random.default_rng(7)
    m = SlotMap(capacity=64)
    ref: dict[int, int] = {}
    for batch in range(12):
        n = int(rng.integers(1, 5000))
        if clustered:  # multiples of 2**52 share the top bits Fibonacci hashing looks at less -> collisions
            keys = (np.arange(n, dtype=np.int64) + 10_000 * batch) << np.int64(11)
        else:
            keys = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
        keys = np.unique(keys[~np.isin(keys, np.fromiter(ref, dtype=np.int64, count=len(ref)))])
        vals = rng.integers(0, 2**40, size=keys.size, dtype=np.int64)
        m.get_or_put(keys, vals)
        ref.update(zip(keys.tolist(), vals.tolist(), strict=True))
        assert len(m) == len(ref)
    k = np.fromiter(ref, dtype=np.int64, count=len(ref))
    assert m.get_many(k).tolist() == [ref[x] for x in k.tolist()]
    assert all(m.get(x) == ref[x] for x in k[:300].tolist())
    probe = rng.integers(-(2**63), 2**63 - 1, size=2000, dtype=np.int64)
    probe = probe[~np.isin(probe, k)]
    assert (m.get_many(probe) == -1).all()
    with pytest.raises(ValueError):
        m.get_or_put(np.array([1, 2], dtype=np.int64), np.array([EMPTY, 3], dtype=np.int64))


def test_rehash_places_keys_whose_probe_runs_wrap_past_the_last_bucket() -> None:
    """Keys hashed into the last buckets of the table: the one-pass placement of a rehash pushes some of them
    past the end, so they wrap to bucket 0. Every key stays reachable, also after deletions (backward shift
    across the wrap) and further inserts, equal to a dict."""
    from kvtier.policies.slotmap import _GOLD, _M64

    inv = pow(_GOLD, -1, 1 << 64)  # Fibonacci hashing is a bijection: pick the hashes, derive the keys

    def key_with_hash(h: int) -> int:
        k = (h * inv) & _M64
        return k - (1 << 64) if k >= 1 << 63 else k

    top = [key_with_hash(_M64 - (j << 40)) for j in range(300)]  # homes in the top buckets at any size
    low = [key_with_hash(j << 50) for j in range(40)]  # homes in the first buckets (the wrapped keys' path)
    m = SlotMap(capacity=16)
    ref: dict[int, int] = {}
    for i, k in enumerate(low + top):  # scalar puts, several rehashes on the way
        m.put(k, i)
        ref[k] = i
        assert m.get(k) == i
    b = m.buckets
    m.reserve(int(b * MAX_LOAD) - len(m) + 1)  # one more (a rehash of a full run at the end)
    assert m.buckets == 2 * b
    assert dict(zip(*(a.tolist() for a in m.items()), strict=True)) == ref
    assert m.get_many(np.array(list(ref), dtype=np.int64)).tolist() == list(ref.values())
    for k in top[::3] + low[::4]:
        assert m.pop(k) == ref.pop(k)
    for k, v in ref.items():
        assert m.get(k) == v
    more = [key_with_hash(_M64 - (j << 40) - 1) for j in range(50)]
    m.put_many(np.array(more, dtype=np.int64), np.arange(50, dtype=np.int64) + 10_000)
    ref.update(zip(more, range(10_000, 10_050), strict=True))
    assert len(m) == len(ref)
    assert m.get_many(np.array(list(ref), dtype=np.int64)).tolist() == list(ref.values())


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("clustered", [False, True])
def test_get_or_put_is_a_setdefault_per_key(
    clustered: bool, scalar: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of distinct keys, part present and part new (clustered keys: long probe runs), through
    growth: present keys keep and return their value, new ones get the offered value, and the map equals a
    dict after each batch. ``scalar``: every key takes the scalar probing tail."""
    if scalar:
        monkeypatch.setattr("kvtier.policies.slotmap._SCALAR_TAIL", 1 << 30)
    rng = np.random.default_rng(11)
    m = SlotMap(capacity=64)
    ref: dict[int, int] = {}
    for batch in range(10):
        n = int(rng.integers(1, 4000))
        if clustered:
            fresh = (np.arange(n, dtype=np.int64) + 7_000 * batch) << np.int64(11)
        else:
            fresh = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
        old = np.fromiter(ref, dtype=np.int64, count=len(ref))
        old = old[rng.random(old.size) < 0.3]
        keys = rng.permutation(np.unique(np.concatenate([fresh, old])))
        vals = rng.integers(0, 2**40, size=keys.size, dtype=np.int64)
        got = m.get_or_put(keys, vals)
        assert got.tolist() == [
            ref.setdefault(k, v) for k, v in zip(keys.tolist(), vals.tolist(), strict=True)
        ]
        assert len(m) == len(ref)
    k = np.fromiter(ref, dtype=np.int64, count=len(ref))
    assert m.get_many(k).tolist() == [ref[x] for x in k.tolist()]
    with pytest.raises(ValueError):
        m.get_or_put(np.array([1, 2], dtype=np.int64), np.array([EMPTY, 3], dtype=np.int64))
