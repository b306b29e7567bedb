"""InFlightMoves gives exactly what a dict of each block's latest move gives: random commits one by one and
in batches (blocks moved again, also within a batch), expiry, compaction, and index rows that move (slots
dropped and reused under a new epoch)."""

from __future__ import annotations

import numpy as np

from kvtier.policies.inflight import InFlightMoves


def test_live_rows_equal_a_dict_of_latest_moves_through_commits_expiry_and_slot_reuse() -> None:
    rng = np.random.default_rng(3)
    n_rows = 3000
    hashes = rng.permutation(np.arange(10_000, 10_000 + n_rows, dtype=np.int64))  # row -> block key
    epoch = 0

    def rows_of(keys: np.ndarray) -> np.ndarray:
        pos = {int(k): r for r, k in enumerate(hashes.tolist())}
        return np.array([pos.get(int(k), -1) for k in keys.tolist()], np.int64)

    inf = InFlightMoves()
    ref: dict[int, tuple[float, int, int]] = {}
    t = 0.0
    for step in range(120):
        t += 1.0
        batch = rng.integers(10_000, 10_000 + n_rows + 200, 60).tolist()  # some never in the index
        bits = [(int(rng.integers(0, 16)), int(rng.integers(0, 16))) for _ in batch]
        if step % 2:  # one at a time, or a tick's moves at once (a block may be listed twice)
            for b, (clear, put) in zip(batch, bits, strict=True):
                inf.record(b, t, clear, put)
        else:
            inf.record_many(batch, t, [c for c, _ in bits], [p for _, p in bits])
        for b, (clear, put) in zip(batch, bits, strict=True):
            ref[b] = (t, clear, put)
        horizon = t - 30.0
        inf.expire(horizon)
        ref = {b: v for b, v in ref.items() if v[0] >= horizon}
        if step % 17 == 5:  # slots dropped and reused: some rows now hold other blocks
            swap = rng.choice(n_rows, 200, replace=False)
            hashes[swap] = rng.permutation(hashes[swap])
            hashes[swap[:20]] = 50_000 + step * 100 + np.arange(20)  # blocks gone from the index
            epoch += 1
        after = t - 10.0
        rows, clear_bits, put_bits = inf.live_rows(after, hashes, rows_of, epoch)
        got = sorted(zip(rows.tolist(), clear_bits.tolist(), put_bits.tolist(), strict=True))
        want_rows = rows_of(np.array([b for b, v in ref.items() if v[0] > after], np.int64))
        want_vals = [v for v in ref.values() if v[0] > after]
        want = sorted(
            (int(r), c, p) for r, (_, c, p) in zip(want_rows.tolist(), want_vals, strict=True) if r >= 0
        )
        assert got == want
        assert len(inf) == len(ref)
        some = list(ref)[:5] + [1]
        assert [inf.at_of(b) for b in some] == [ref[b][0] if b in ref else None for b in some]


def test_rows_are_looked_up_again_without_an_epoch() -> None:
    inf = InFlightMoves()
    hashes = np.array([7, 8, 9], np.int64)
    inf.record(8, 1.0, 1, 2)
    calls: list[list[int]] = []

    def rows_of(keys: np.ndarray) -> np.ndarray:
        calls.append(keys.tolist())
        return np.array([int(np.flatnonzero(hashes == k)[0]) if (hashes == k).any() else -1 for k in keys])

    assert inf.live_rows(0.0, hashes, rows_of, epoch=1)[0].tolist() == [1]
    assert inf.live_rows(0.0, hashes, rows_of, epoch=1)[0].tolist() == [1] and len(calls) == 1  # cached
    hashes[:] = [8, 7, 9]  # the block now lives in row 0 (same epoch: the hash check catches it)
    assert inf.live_rows(0.0, hashes, rows_of, epoch=1)[0].tolist() == [0] and len(calls) == 2
    inf.live_rows(0.0, hashes, rows_of, epoch=None)
    assert len(calls) == 3
