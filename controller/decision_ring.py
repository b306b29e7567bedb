"""The newest decisions (what ``/v1/decisions`` shows) as columns in a fixed ring, not as objects.

~20k :class:`Decision` objects alive at a time were nearly all of the sidecar's GC-tracked objects: every
~20 ticks the cyclic GC's full collection traversed them (15-30 ms at 1M blocks), inside whichever tick
allocated last. Here a decision is ~90 B of numpy columns plus a ``detail`` string in one list (the GC
visits one container); strings repeat, so action / tiers / layer / outcome are small codes. Decisions go in
as objects and come out as fresh objects (:meth:`DecisionRing.get`): a snapshot, not a live view.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.actuators.base import Outcome

if TYPE_CHECKING:
    from kvtier.controller.decisions import Decision

_NUM: tuple[tuple[str, Any], ...] = (
    ("id", np.int64),
    ("tick", np.int64),
    ("at", np.float64),
    ("block", np.int64),
    ("value", np.float64),
    ("p", np.float64),
    ("pinned", np.bool_),
    ("tokens", np.int64),
    ("freq0", np.int64),
    ("back", np.int8),  # came_back: -1 None, 0 False, 1 True
    ("score", np.float64),  # NaN: None
    ("scored_at", np.float64),  # NaN: None
)
_CODED = ("action", "src", "tier", "layer", "outcome")  # str | None -> int16 code (-1: None)


class StringCodes:
    """Repeated strings as small int codes (None: -1), first seen first."""

    def __init__(self) -> None:
        self._strs: list[str] = []
        self._code: dict[str, int] = {}

    def code(self, s: str | None) -> int:
        if s is None:
            return -1
        c = self._code.get(s)
        if c is None:
            c = self._code[s] = len(self._strs)
            self._strs.append(s)
        return c

    def known(self, s: str) -> int | None:
        """The code of ``s`` if it was ever coded, else None."""
        return self._code.get(s)

    def name(self, c: int) -> str | None:
        return None if c < 0 else self._strs[c]


def _score_fields(d: Decision) -> tuple[int, float, float]:
    """(came_back as -1 / 0 / 1, score, scored_at_s), None as -1 / NaN."""
    return (
        -1 if d.came_back is None else int(d.came_back),
        math.nan if d.score is None else d.score,
        math.nan if d.scored_at_s is None else d.scored_at_s,
    )


class DecisionRing:
    """The newest ``max_len`` decisions, oldest overwritten first. Not thread-safe (the log locks)."""

    def __init__(self, max_len: int, make: type[Decision]) -> None:
        """``make``: the decision class (:class:`~kvtier.controller.decisions.Decision`)."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self._make = make
        self._c: dict[str, npt.NDArray[Any]] = {c: np.zeros(max_len, t) for c, t in _NUM}
        for c in _CODED:
            self._c[c] = np.full(max_len, -1, np.int16)
        self._detail: list[str] = [""] * max_len
        self.codes = StringCodes()  # action / tiers / layer / outcome
        self._pos: dict[int, int] = {}  # id -> position (ints only: untracked by the GC)
        self._next = 0  # position of the next write
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def extend(self, ds: Iterable[Decision]) -> None:
        """Append ``ds`` in order (one column write each; the oldest are overwritten when full)."""
        ds = list(ds)[-self.max_len :]
        k = len(ds)
        if k == 0:
            return
        size, c, pos_of = self.max_len, self._c, self._pos
        pos = (self._next + np.arange(k, dtype=np.int64)) % size
        first_old = size - self._n  # ds[j] overwrites an entry iff j >= first_old
        if first_old < k:
            for old, p in zip(c["id"][pos[first_old:]].tolist(), pos[first_old:].tolist(), strict=True):
                if pos_of.get(old) == p:
                    del pos_of[old]
        self._n = min(size, self._n + k)
        self._next = int(pos[-1] + 1) % size
        ids = [d.id for d in ds]
        pos_of.update(zip(ids, pos.tolist(), strict=True))
        c["id"][pos] = ids
        c["tick"][pos] = [d.tick for d in ds]
        c["at"][pos] = [d.at_s for d in ds]
        c["block"][pos] = [d.block for d in ds]
        c["value"][pos] = [d.value_s for d in ds]
        c["p"][pos] = [d.p_reuse for d in ds]
        c["pinned"][pos] = [d.pinned for d in ds]
        c["tokens"][pos] = [d.tokens for d in ds]
        c["freq0"][pos] = [d.freq0 for d in ds]
        c["back"][pos], c["score"][pos], c["scored_at"][pos] = zip(*map(_score_fields, ds), strict=True)
        enc = self.codes.code
        for name in _CODED:
            c[name][pos] = [enc(getattr(d, name)) for d in ds]
        detail = self._detail
        for p, d in zip(pos.tolist(), ds, strict=True):
            detail[p] = d.detail

    def update_scores(self, ds: Iterable[Decision]) -> None:
        """Write the scores of those of ``ds`` still in the ring."""
        for d in ds:
            i = self._pos.get(d.id)
            if i is not None:
                c = self._c
                c["back"][i], c["score"][i], c["scored_at"][i] = _score_fields(d)

    def get(self, i: int) -> Decision:
        """The decision at position ``i``, as a new object."""
        c = self._c
        back, sc, sat = int(c["back"][i]), float(c["score"][i]), float(c["scored_at"][i])
        dec = self.codes.name
        return self._make(
            id=int(c["id"][i]),
            tick=int(c["tick"][i]),
            at_s=float(c["at"][i]),
            action=dec(int(c["action"][i])) or "",
            block=int(c["block"][i]),
            src=dec(int(c["src"][i])),
            tier=dec(int(c["tier"][i])),
            value_s=float(c["value"][i]),
            p_reuse=float(c["p"][i]),
            pinned=bool(c["pinned"][i]),
            layer=dec(int(c["layer"][i])) or "",
            outcome=Outcome(dec(int(c["outcome"][i])) or Outcome.PLANNED),
            detail=self._detail[i],
            tokens=int(c["tokens"][i]),
            freq0=int(c["freq0"][i]),
            came_back=None if back < 0 else bool(back),
            score=None if math.isnan(sc) else sc,
            scored_at_s=None if math.isnan(sat) else sat,
        )

    def by_id(self, decision_id: int) -> Decision | None:
        i = self._pos.get(decision_id)
        return None if i is None else self.get(i)

    def _newest_first(self) -> npt.NDArray[np.int64]:
        """Positions, newest first."""
        return (self._next - 1 - np.arange(self._n, dtype=np.int64)) % self.max_len

    def query(
        self,
        limit: int,
        action: str | None = None,
        tier: str | None = None,
        block: int | None = None,
        outcome: str | None = None,
    ) -> list[Decision]:
        """Newest first, filtered (vectorised over the codes)."""
        order = self._newest_first()
        if order.size == 0 or limit <= 0:
            return []
        keep = np.ones(order.size, np.bool_)
        c = self._c
        for name, want in (("action", action), ("tier", tier), ("outcome", outcome)):
            if want is not None:
                code = self.codes.known(want)
                if code is None:
                    return []
                keep &= c[name][order] == code
        if block is not None:
            keep &= c["block"][order] == block
        return [self.get(int(i)) for i in order[keep][:limit].tolist()]

    def __iter__(self) -> Iterator[Decision]:
        """Oldest first (a snapshot)."""
        return iter([self.get(int(i)) for i in self._newest_first()[::-1].tolist()])
