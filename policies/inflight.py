"""The planner's committed moves as arrays, for the per-tick "assume in-flight moves are done" pass.

One entry per committed move (a block's newer move supersedes its older one): commit time (s), block key,
the tier bits the move clears and sets, and the block's index row as last resolved. A tick reads the live
entries with array operations instead of walking a dict of tuples, and looks up only the rows that are
unknown or stale (a cached row is trusted only while the index still holds that block there). Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

_MIN_CAP = 1024


class InFlightMoves:
    """Committed moves, newest entry per block valid; see the module docstring."""

    def __init__(self) -> None:
        self._n = 0  # entries used (valid or not)
        self._live = 0  # valid entries
        self._alloc(_MIN_CAP)
        self._pos: dict[int, int] = {}  # block -> its valid entry
        self._epoch: object = None  # index slot epoch the cached rows were resolved under

    def _alloc(self, cap: int) -> None:
        self.at = np.zeros(cap, np.float64)
        self.key = np.zeros(cap, np.int64)
        self.clear = np.zeros(cap, np.uint8)
        self.put = np.zeros(cap, np.uint8)
        self.row = np.full(cap, -1, np.int64)
        self.valid = np.zeros(cap, np.bool_)

    def __len__(self) -> int:
        return self._live

    def record(self, block: int, at_s: float, clear: int, put: int) -> None:
        """A move of ``block`` committed at ``at_s`` (replaces the block's earlier entry)."""
        self.record_many([block], at_s, [clear], [put])

    def record_many(self, blocks: list[int], at_s: float, clear: list[int], put: list[int]) -> None:
        """:meth:`record` for each move in order (a block listed twice keeps its last move), in one pass
        of array writes."""
        last = {b: j for j, b in enumerate(blocks)}  # the last move of each block
        if len(last) < len(blocks):
            js = sorted(last.values())
            blocks, clear, put = [blocks[j] for j in js], [clear[j] for j in js], [put[j] for j in js]
        m = len(blocks)
        if m == 0:
            return
        old = [i for i in map(self._pos.get, blocks) if i is not None]
        if old:
            self.valid[old] = False
            self._live -= len(old)
        if self._n + m > self.at.shape[0]:
            self._compact(grow=True, room=m)
        i, j = self._n, self._n + m
        self.at[i:j] = at_s
        self.key[i:j] = blocks
        self.clear[i:j] = clear
        self.put[i:j] = put
        self.row[i:j] = -1
        self.valid[i:j] = True
        self._pos.update(zip(blocks, range(i, j), strict=True))  # (a compaction made a new dict)
        self._n = j
        self._live += m

    def at_of(self, block: int) -> float | None:
        """Commit time (s) of ``block``'s live move, None if it has none."""
        i = self._pos.get(block)
        return None if i is None else float(self.at[i])

    def expire(self, horizon_s: float) -> None:
        """Drop the entries committed before ``horizon_s``."""
        n = self._n
        old = np.flatnonzero(self.valid[:n] & (self.at[:n] < horizon_s))
        if old.size:
            self.valid[old] = False
            self._live -= int(old.size)
            pos = self._pos
            for k in self.key[old].tolist():
                del pos[k]
        if self._n > 2 * self._live + _MIN_CAP:
            self._compact(grow=False)

    def _compact(self, grow: bool, room: int = 1) -> None:
        """Drop the invalid entries; with ``grow``, leave room for ``room`` more."""
        keep = np.flatnonzero(self.valid[: self._n])
        cols: list[npt.NDArray[np.generic]] = [
            a[keep] for a in (self.at, self.key, self.clear, self.put, self.row)
        ]
        cap = max(_MIN_CAP, 2 * keep.size, self.at.shape[0] * 2 if grow and keep.size * 2 > self._n else 0)
        cap = max(cap, keep.size + room) if grow else cap
        self._alloc(cap)
        m = keep.size
        for name, c in zip(("at", "key", "clear", "put", "row"), cols, strict=True):
            getattr(self, name)[:m] = c
        self.valid[:m] = True
        self._n = self._live = m
        self._pos = dict(zip(self.key[:m].tolist(), range(m), strict=True))

    def live_rows(
        self,
        after_s: float,
        hashes: npt.NDArray[np.int64],
        rows_of: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]],
        epoch: object = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
        """(rows, clear bits, set bits) of the entries committed after ``after_s`` whose block the index
        tracks (``hashes``: the index's block key per row; ``rows_of``: key -> row, -1 if absent).
        ``epoch``: the index's slot epoch (changes when slots are dropped); rows resolved under another
        epoch, or with ``epoch=None``, are looked up again."""
        n = self._n
        sel = np.flatnonzero(self.valid[:n] & (self.at[:n] > after_s))
        if sel.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(0, np.uint8)
        if epoch is None or epoch != self._epoch:
            self.row[:n] = -1
            self._epoch = epoch
        keys, rows = self.key[sel], self.row[sel]
        ok = (rows >= 0) & (rows < hashes.shape[0])
        ok[ok] = hashes[rows[ok]] == keys[ok]
        stale = np.flatnonzero(~ok)
        if stale.size:
            got = rows_of(keys[stale])
            rows[stale] = got
            self.row[sel[stale]] = got
        found = rows >= 0
        return rows[found], self.clear[sel][found], self.put[sel][found]
