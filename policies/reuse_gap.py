"""Is a chunk that came back after a gap likely to come back again? Learned online, by the gap's length.

When a chunk is seen for the second time, the number of requests since its first sight (its *gap*) says
something about whether it will be needed a third time: on the bundled conversation trace a chunk back
within 250 requests (the next turn of a conversation, after the user's think time) is used again 37 % of
the time, one back after 300 or more requests 8 % (plausibly a prefix a later conversation happens to
share; the trace has no session ids to tell). The L1 keeper reloads a chunk it dropped into L1 at its
second sight (readmission); a chunk that will not be used again only takes the room of one that would.

Per gap bin (``bit_length`` of the gap in requests: 1, 2-3, 4-7, ..., 512-1023, capped), the estimate is
the share of second sights followed by a third within ``horizon`` requests -- counted only once a sample is
``horizon`` requests old, so a bin's rate is not inflated by its early positives and every label comes from
the past. :meth:`pays` says whether a chunk back after ``gap`` requests is at least as likely to be used
again as the average second sight; a bin with fewer than ``min_samples`` matured samples pays (the keeper's
behaviour before it has evidence). Comparing to the average instead of to a fixed rate keeps the rule free
of a threshold fitted to one trace.

Units: requests (gaps, horizon). Keys are any hashable chunk identifiers. Memory is bounded by the samples
younger than ``horizon``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

MAX_BIN = 12  # gaps of 2,048 requests and more share one bin


def gap_bin(gap: int) -> int:
    """The bin of a gap of ``gap`` requests: 0 for 0, then one per power of two, capped at ``MAX_BIN``."""
    return min(max(0, gap).bit_length(), MAX_BIN)


@dataclass
class ReuseByGap:
    """See module doc. ``observe_second_sight`` / ``observe_sight`` are fed in request order."""

    horizon: int = 256
    min_samples: int = 20
    n: list[int] = field(default_factory=lambda: [0] * (MAX_BIN + 1))  # matured samples per bin
    pos: list[int] = field(default_factory=lambda: [0] * (MAX_BIN + 1))  # ... followed by a third sight
    _pending: deque[tuple[int, Hashable, int]] = field(default_factory=deque)  # (request, key, bin)
    _open: dict[Hashable, int] = field(default_factory=dict)  # key -> request of its pending second sight
    _hit: set[Hashable] = field(default_factory=set)  # pending keys seen a third time within the horizon

    def observe_second_sight(self, now: int, key: Hashable, gap: int) -> None:
        """``key`` was just seen for the second time, at request ``now``, ``gap`` requests after its first."""
        self._mature(now)
        self._pending.append((now, key, gap_bin(gap)))
        self._open[key] = now

    def observe_sight(self, now: int, key: Hashable) -> None:
        """``key`` was seen again (a third or later sight) at request ``now``."""
        t = self._open.get(key)
        if t is not None and t < now and now - t <= self.horizon:
            self._hit.add(key)

    def _mature(self, now: int) -> None:
        while self._pending and now - self._pending[0][0] > self.horizon:
            t, key, b = self._pending.popleft()
            self.n[b] += 1
            if self._open.get(key) == t:
                del self._open[key]
                if key in self._hit:
                    self._hit.discard(key)
                    self.pos[b] += 1

    def rate(self, gap: int) -> float | None:
        """Share of matured second sights in ``gap``'s bin used again within the horizon; None if too few."""
        b = gap_bin(gap)
        return self.pos[b] / self.n[b] if self.n[b] >= self.min_samples else None

    def mean_rate(self) -> float | None:
        """The same share over every matured second sight; None before ``min_samples`` of them."""
        total = sum(self.n)
        return sum(self.pos) / total if total >= self.min_samples else None

    def pays(self, now: int, gap: int) -> bool:
        """Whether a chunk back after ``gap`` requests is worth its L1 room (see module doc)."""
        self._mature(now)
        r, m = self.rate(gap), self.mean_rate()
        return r is None or m is None or r >= m

    def status(self) -> dict[str, object]:
        """Per-bin matured samples and rates, for ``/v1/status``."""
        return {
            "horizon_requests": self.horizon,
            "mean_rate": self.mean_rate(),
            "bins": {
                f"gap<{1 << b}" if b < MAX_BIN else f"gap>={1 << (MAX_BIN - 1)}": [self.n[b], self.pos[b]]
                for b in range(MAX_BIN + 1)
                if self.n[b]
            },
        }
