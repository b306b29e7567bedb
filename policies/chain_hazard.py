"""How likely is a request's chunk chain to be continued by a later prompt, by its age? Learned online.

A request *continues* an earlier one when its prompt's known prefix reaches past the first ``min_prefix``
chunks (a prefix every prompt may share, such as a system prompt) into chunks last used by that request:
the next turn of a conversation, a follow-up question on the same document. The continued chain's *age* is
the number of requests between the two. Per age bin of ``bin_requests`` requests (and, with ``by_turn``, per
turn: how many continuations led to the chain, capped at 4), the estimate is continuations seen at that
age over chain-requests spent at that age -- both counted from the past only, so it is causal.

Why by age and not by recency: in a conversation trace the next turn comes back after tens to hundreds of
requests (the user reads and types), so a chain used a moment ago is *less* likely to be needed next than
one in the think-time peak; an LRU keeps the former and drops the latter. Ranking LMCache MP's L1
evictions by this rate instead of recency did not pay on the live rig, and does not in the calibrated
simulator once it models the keeper's calibration hold (``bench.l1_admission_bound``;
docs/perf/live_ab_lmcache_l1.md), so the keeper uses it only when configured.

Units: requests (ages, bins), chunks (chains). Keys are any hashable chunk identifiers. Memory is bounded:
``max_age`` requests of live chains, ``max_keys`` last users.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Container, Hashable, Iterable, Sequence


class ChainHazard:
    """See module doc. Requests are numbered by the caller, ascending (``observe``'s ``i``)."""

    def __init__(
        self,
        *,
        bin_requests: int = 16,
        max_age: int = 640,
        by_turn: bool = False,
        min_prefix: int = 1,
        max_keys: int = 1 << 20,
    ) -> None:
        self.w, self.max_age, self.by_turn, self.min_prefix = bin_requests, max_age, by_turn, min_prefix
        self.max_keys = max_keys
        self.cont: Counter[tuple[int, int]] = Counter()  # (turn class, age bin) -> continuations
        self.exposure: Counter[tuple[int, int]] = Counter()  # (turn class, age bin) -> chain-requests
        self.live: dict[int, list[Hashable]] = {}  # request index -> its chain, while it may be continued
        self.turn: dict[int, int] = {}  # live request index -> its turn class
        self.last_user: OrderedDict[Hashable, int] = OrderedDict()  # chunk -> last request that used it
        self.now = -1  # the latest request index observed

    def observe(self, i: int, chain: Sequence[Hashable], *, continues: bool = False) -> None:
        """Request ``i`` looked up ``chain`` (root first): learn from it, then track it.

        ``continues``: ``chain`` is more of request ``i``'s own prompt (a prefill in pieces), not a new
        request: its chunks join request ``i``'s chain and nothing is learned."""
        if continues and i in self.live:
            self.live[i].extend(chain)
            self._use(i, chain)
            return
        k = 0
        while k < len(chain) and chain[k] in self.last_user:
            k += 1
        turn = 1
        if k > self.min_prefix:
            j = self.last_user[chain[k - 1]]
            if j in self.live and j < i:
                self.cont[self.turn[j], (i - j) // self.w] += 1
                turn = self.turn[j] + 1
                del self.live[j], self.turn[j]
        self._use(i, chain)
        self.live[i] = list(chain)
        self.turn[i] = min(turn, 4) if self.by_turn else 1
        self.now = max(self.now, i)
        for j in list(self.live):
            if i - j > self.max_age:
                del self.live[j], self.turn[j]
            else:
                self.exposure[self.turn[j], (i - j) // self.w] += 1

    def _use(self, i: int, chain: Iterable[Hashable]) -> None:
        for b in chain:
            self.last_user[b] = i
            self.last_user.move_to_end(b)
        while len(self.last_user) > self.max_keys:
            self.last_user.popitem(last=False)

    def rate(self, j: int, i: int) -> float:
        """Continuations per chain-request for live request ``j``'s chain at request ``i``, shrunk towards 0
        while its (turn, age) cell has little exposure. A chain no longer live (continued, or older than
        ``max_age``) rates 0."""
        if j not in self.live:
            return 0.0
        cell = (self.turn[j], (i - j) // self.w)
        return self.cont[cell] / (self.exposure[cell] + self.w)

    def hold(self, i: int, budget: int) -> set[Hashable]:
        """Chunks of the live chains most likely continued next (older than request ``i``), up to
        ``budget`` chunks; ties go to the younger chain."""
        out: set[Hashable] = set()
        for j in sorted((j for j in self.live if j < i), key=lambda j: (-self.rate(j, i), -j)):
            if self.rate(j, i) <= 0.0:
                break
            c = self.live[j]
            if len(out | set(c)) <= budget:
                out.update(c)
        return out

    def coldest(self, resident: Iterable[Hashable], n: int, keep: Container[Hashable] = ()) -> list[Hashable]:
        """Up to ``n`` of ``resident`` (oldest first, as an LRU iterates) least likely needed next: first
        chunks whose last request is no longer live or unknown (oldest first: what an LRU drops), then the
        chunks of live chains by ascending rate at their age (ties: the older chain). Never a chunk of the
        latest request (in flight or just written) nor one in ``keep``."""
        if n <= 0:
            return []
        out: list[Hashable] = []
        mine: dict[int, list[Hashable]] = {}
        for b in resident:
            if b in keep:
                continue
            j = self.last_user.get(b)
            if j is None or j not in self.live:
                out.append(b)
                if len(out) >= n:
                    return out
            elif j < self.now:
                mine.setdefault(j, []).append(b)
        for j in sorted(mine, key=lambda j: (self.rate(j, self.now), j)):
            take = mine[j][: n - len(out)]
            out.extend(take)
            if len(out) >= n:
                break
        return out
