"""The emulated cache layer, running its own default policy, and the links it pays for.

- HBM (tier 0) is vLLM's prefix cache: LRU over freed blocks, touched on every hit from HBM.
- With offload, an LMCache-like layer below: L1 (DRAM) LRU, every stored block written through to L2
  (disk, LRU), an L2 hit is loaded back through L1 (and kept there). LMCache is only asked for the part of a
  prompt HBM misses, so an HBM hit does not refresh the block's L1 recency (as in vLLM + LMCache).
  ``disk_admission="frequency2"`` writes a block to L2 only from its second access on (Dynamo KVBM).
- Every transfer reserves its link (``src->dst``: FIFO, ``latency + bytes / bandwidth``), so prefetches
  compete with demand loads; a block moved ahead of use is usable only when its transfer ends.
- :class:`LayerBehaviour` switches on details of LMCache MP 0.5.6 read from its source and checked against
  the real stack (docs/perf/calibration.md): the whole prompt's L1 chunks touched at the request's end,
  a chain's tail least recent, L2 hits loaded only temporarily into L1, and L1 eviction by a periodic
  watermark loop (a store that does not fit is dropped, from L1 and from the write-through to L2).
- Residency changes are reported to an optional :class:`ResidencyObserver` the way the real layer's
  events report them (stored / removed per tier), which is what a sidecar's block index consumes.

Times are simulated seconds (``now``) from the serving model's clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.policies.tiers import Tier, TierSpec


@dataclass(frozen=True)
class LayerBehaviour:
    """Details of the real layer's default policy; the defaults are the simulator's original model.

    - ``touch_whole_prompt``: at a request's end every chunk of its prompt held in L1 becomes recent, HBM hits
      included (LMCache MP ``end_session`` touches all of the session's keys); otherwise only L1 hits are.
    - ``tail_first``: within a request's chain the tail is the least recent (LMCache's LRU adds and touches
      keys in reverse order; vLLM frees a request's blocks tail first), in HBM and L1.
    - ``retain_l2_hits``: an L2 hit loaded through L1 stays in L1 (LMCache's default prefetch policy loads
      it as a temporary object: False).
    - ``l1_watermark`` (fraction of capacity, None = evict on insert): L1 is trimmed by a loop every
      ``l1_eviction_interval_s`` seconds that, when ``len >= l1_watermark x capacity``, evicts
      ``int(len x l1_eviction_ratio)`` least recent blocks; a store whose blocks do not fit is dropped.
    - ``l2_loads_stage_in_l1``: a look-up's L2 hits are loaded into L1 staging buffers reserved at look-up
      time in one all-or-nothing allocation; when L1 has no room for all of them the found prefix ends at
      the first (LMCache MP ``prefetch_controller._reserve_l1_cells`` -> ``L1Manager.reserve_write``; failed
      reservations drop their L2 locks and the load is re-planned on what was reserved; the look-up counts
      only what was loaded). With the watermark loop L1 is full between two runs of the loop, so at a
      fast pace L2 hits are lost.
    - ``l1_hits_prefix_only``: the layer's look-up counter credits L1 with the leading run of the found
      prefix that L1 holds; from the first chunk found only below L1 on, the rest of the found prefix counts
      as that lower tier's, L1-held chunks included (LMCache MP ``modules/lookup.py``: ``l1_hit_tokens`` is
      the prefix L1's own cells serve). Serving is unchanged: only ``layer_lookup_tokens`` follows it.
    """

    touch_whole_prompt: bool = False
    tail_first: bool = False
    retain_l2_hits: bool = True
    l1_watermark: float | None = None
    l1_eviction_ratio: float = 0.2
    l1_eviction_interval_s: float = 1.0
    l2_loads_stage_in_l1: bool = False
    l1_hits_prefix_only: bool = False


class ResidencyObserver(Protocol):
    def stored(self, block: int, parent: int | None, tier: Tier, now: float) -> None: ...

    def removed(self, block: int, tier: Tier) -> None: ...

    def accessed(self, chain: Sequence[int], now: float) -> None: ...


@dataclass
class Link:
    """One direction of one physical link: FIFO transfers (latency + bytes / bandwidth)."""

    name: str
    bytes_s: float
    latency_s: float
    free_at: float = 0.0
    bytes_moved: int = 0
    busy_s: float = 0.0

    def reserve(self, now: float, nbytes: int, earliest: float | None = None) -> float:
        """Queue a transfer of ``nbytes`` starting no sooner than ``earliest``; returns its end time."""
        if nbytes <= 0:
            return max(now, earliest or now)
        start = max(now, self.free_at, earliest if earliest is not None else now)
        dur = self.latency_s + nbytes / self.bytes_s
        self.free_at = start + dur
        self.bytes_moved += nbytes
        self.busy_s += dur
        return self.free_at


@dataclass
class Lookup:
    """What one request found: per prefix block its tier (``None`` past the first miss)."""

    tiers: list[Tier | None]
    hit_blocks: int
    ready_at: float  # when every hit block is in HBM
    by_tier: Counter[Tier] = field(default_factory=Counter)


class _Tier:
    def __init__(self, hw: TierSpec) -> None:
        self.hw = hw
        self.lru: OrderedDict[int, float] = OrderedDict()  # block -> ready_at (s)

    def __contains__(self, b: int) -> bool:
        return b in self.lru


class CacheLayer:
    """HBM prefix cache + (with ``offload``) the layer's lower tiers; see the module doc."""

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        block_bytes: int,
        *,
        offload: bool = True,
        disk_admission: str = "all",
        observer: ResidencyObserver | None = None,
        behaviour: LayerBehaviour | None = None,
        l1_loop_first_s: float | None = None,
        l1_loop_times_s: Sequence[float] = (),
    ) -> None:
        self.block_bytes = block_bytes
        self.bh = behaviour or LayerBehaviour()
        # s, the L1 watermark loop's next run: one interval in by default; the real loop's phase against a
        # workload is set by when the layer started, which the caller may know or sample. An observed
        # schedule (``l1_loop_times_s``, ascending) is followed first; after it the loop keeps its interval.
        self._loop_times = deque(sorted(t for t in l1_loop_times_s if t >= 0.0))
        first = self.bh.l1_eviction_interval_s if l1_loop_first_s is None else l1_loop_first_s
        self._next_trim = self._loop_times.popleft() if self._loop_times else first
        self.hw = list(tiers if offload else tiers[:1])
        self.t: dict[Tier, _Tier] = {h.tier: _Tier(h) for h in self.hw}
        self.order = [h.tier for h in self.hw]
        self.lower = self.order[1:]  # the layer's own tiers (L1, L2, ...)
        self.disk_admission = disk_admission
        self.observer = observer
        self.links: dict[str, Link] = {}
        for h in self.hw[1:]:
            up = Tier.GPU if h.tier is Tier.CPU else Tier.CPU
            load, write = f"{h.tier.value}->{up.value}", f"{up.value}->{h.tier.value}"
            self.links[load] = Link(load, h.load_bandwidth_bytes_s, h.latency_s)  # loads towards the engine
            self.links[write] = Link(write, h.write_bytes_s, h.latency_s)  # writes into the tier
        self.freq: Counter[int] = Counter()
        self.hit_tokens: Counter[str] = Counter()  # tier -> prompt tokens served from it
        # tier -> prompt tokens the layer's own lookup found there: LMCache MP looks up the whole prompt
        # (from token 0, HBM hits included) and counts each chunk of the found prefix in the first of its
        # tiers holding it (lmcache_mp_lookup_hit_l{1,2}_tokens)
        self.layer_lookup_tokens: Counter[str] = Counter()
        self.lookup_tokens = 0
        self.evictions: Counter[str] = Counter()
        self.store_failures = 0  # blocks a full L1 refused (watermark model)
        self.l2_staging_failures = 0  # L2 hits lost: no L1 room to stage them (l2_loads_stage_in_l1)
        self.now = 0.0

    # -- residency -------------------------------------------------------------------------------------
    def where(self, b: int) -> Tier | None:
        for t in self.order:
            if b in self.t[t].lru:
                return t
        return None

    def resident(self, tier: Tier) -> int:
        return len(self.t[tier].lru) if tier in self.t else 0

    def _put(self, tier: Tier, b: int, parent: int | None, ready_at: float) -> None:
        st = self.t[tier]
        if b in st.lru:
            st.lru[b] = max(st.lru[b], ready_at) if ready_at > self.now else st.lru[b]
            st.lru.move_to_end(b)
            return
        st.lru[b] = ready_at
        if self.observer is not None:
            self.observer.stored(b, parent, tier, self.now)
        while len(st.lru) > st.hw.capacity_blocks and not self._watermarked(tier):
            old, _ = st.lru.popitem(last=False)
            self.evictions[tier.value] += 1
            if self.observer is not None:
                self.observer.removed(old, tier)

    def _watermarked(self, tier: Tier) -> bool:
        return self.bh.l1_watermark is not None and bool(self.lower) and tier is self.lower[0]

    def _trim(self) -> None:
        """Run the L1 eviction loop for every period that ended by ``now`` (the state between two layer
        operations does not change, so running the missed periods now is exact)."""
        if self.bh.l1_watermark is None or not self.lower:
            return
        st = self.t[self.lower[0]]
        iv = self.bh.l1_eviction_interval_s
        while self._next_trim <= self.now:
            if len(st.lru) < self.bh.l1_watermark * st.hw.capacity_blocks:  # nothing changes until now
                while self._loop_times and self._next_trim <= self.now:
                    self._advance_trim(iv)
                if self._next_trim <= self.now:
                    self._next_trim += ((self.now - self._next_trim) // iv + 1) * iv
                break
            self._advance_trim(iv)
            for _ in range(int(len(st.lru) * self.bh.l1_eviction_ratio)):
                old, _ = st.lru.popitem(last=False)
                self.evictions[st.hw.tier.value] += 1
                if self.observer is not None:
                    self.observer.removed(old, st.hw.tier)

    def _advance_trim(self, iv: float) -> None:
        self._next_trim = self._loop_times.popleft() if self._loop_times else self._next_trim + iv

    def _recent(self, tier: Tier, chain: Sequence[int]) -> None:
        """Make the chain's blocks held in ``tier`` the most recent, its head last (tail first out)."""
        lru = self.t[tier].lru
        for b in reversed(chain):
            if b in lru:
                lru.move_to_end(b)

    def _drop(self, tier: Tier, b: int) -> bool:
        st = self.t.get(tier)
        if st is None or b not in st.lru:
            return False
        del st.lru[b]
        if self.observer is not None:
            self.observer.removed(b, tier)
        return True

    def _copy(self, src: Tier, dst: Tier, blocks: list[int], earliest: float | None = None) -> float:
        """Reserve the ``src->dst`` link for ``blocks`` (one transfer); returns when it ends."""
        if not blocks:
            return self.now
        link = self.links.get(f"{src.value}->{dst.value}")
        if link is None:  # no direct link (e.g. disk -> gpu): go through cpu
            mid = self._copy(src, Tier.CPU, blocks, earliest)
            return self._copy(Tier.CPU, dst, blocks, mid)
        return link.reserve(self.now, len(blocks) * self.block_bytes, earliest)

    # -- the serving path --------------------------------------------------------------------------------
    def lookup(self, chain: Sequence[int], input_tokens: int, block_tokens: int) -> Lookup:
        """Find the request's cached prefix and load it into HBM (demand loads reserve the links)."""
        now = self.now
        self._trim()
        if self.observer is not None:
            self.observer.accessed(chain, now)
        for b in chain:
            self.freq[b] += 1
        layer_found = self._layer_prefix(chain)
        for k, lt in enumerate(self._credited(layer_found)):
            self.layer_lookup_tokens[lt.value] += min(block_tokens, max(0, input_tokens - k * block_tokens))
        tiers: list[Tier | None] = []
        for k, b in enumerate(chain):
            t = self.where(b)
            if t is None or (self.bh.l2_loads_stage_in_l1 and t is not Tier.GPU and k >= len(layer_found)):
                break  # beyond HBM the engine gets only the layer's found prefix
            tiers.append(t)
        n = len(tiers)
        tiers.extend([None] * (len(chain) - n))
        by_tier: Counter[Tier] = Counter(t for t in tiers if t is not None)
        ready = now
        gpu = self.t[Tier.GPU]
        from_cpu: list[int] = []
        from_below: dict[Tier, list[int]] = {}
        for b, t in zip(chain[:n], tiers[:n], strict=True):
            assert t is not None  # the first n blocks were found
            ready = max(ready, self.t[t].lru[b])  # a prefetch still in flight
            if t is Tier.GPU:
                gpu.lru.move_to_end(b)
            elif t is Tier.CPU:
                self.t[Tier.CPU].lru.move_to_end(b)
                from_cpu.append(b)
            else:
                from_below.setdefault(t, []).append(b)
        end = ready
        for t, bl in from_below.items():  # L2 -> L1 (kept in L1), then with the L1 hits -> HBM
            e = self._copy(t, Tier.CPU, bl, ready)
            if self.bh.retain_l2_hits:
                for b in bl:
                    self._put(Tier.CPU, b, None, e)
            end = max(end, self._copy(Tier.CPU, Tier.GPU, bl, e))
        end = max(end, self._copy(Tier.CPU, Tier.GPU, from_cpu, ready))
        parent: int | None = None
        for b, t in zip(chain[:n], tiers[:n], strict=True):
            if t is not Tier.GPU:
                self._put(Tier.GPU, b, parent, end)
            parent = b
        hit_tok = min(n * block_tokens, input_tokens)
        self.lookup_tokens += input_tokens
        for k, t in enumerate(tiers[:n]):
            assert t is not None
            self.hit_tokens[t.value] += min(block_tokens, max(0, input_tokens - k * block_tokens))
        return Lookup(tiers, n if hit_tok else 0, end, by_tier)

    def _credited(self, found: list[Tier]) -> list[Tier]:
        """The tier the layer's look-up counter credits with each chunk of its found prefix (see
        ``l1_hits_prefix_only``)."""
        if not self.bh.l1_hits_prefix_only or not self.lower:
            return found
        l1 = self.lower[0]
        gap = next((k for k, t in enumerate(found) if t is not l1), len(found))
        return found[:gap] + [found[gap] if t is l1 else t for t in found[gap:]]

    def _layer_prefix(self, chain: Sequence[int]) -> list[Tier]:
        """The layer's own look-up from the prompt's first block (HBM hits included): the first lower tier
        holding each block of the found prefix. With ``l2_loads_stage_in_l1`` the blocks found only below L1
        need L1 staging buffers, reserved in one all-or-nothing allocation (LMCache ``reserve_write``): when
        L1 has fewer free slots than that, the prefix ends at the first of them."""
        found: list[Tier] = []
        for b in chain:
            lt = next((t for t in self.lower if b in self.t[t].lru), None)
            if lt is None:
                break
            found.append(lt)
        if self.bh.l2_loads_stage_in_l1 and self.lower:
            l1 = self.t[self.lower[0]]
            below = [k for k, t in enumerate(found) if t is not l1.hw.tier]
            if below and len(below) > l1.hw.capacity_blocks - len(l1.lru):
                self.l2_staging_failures += len(below)
                del found[below[0] :]
        return found

    def store(self, chain: Sequence[int], hit_blocks: int) -> None:
        """The prompt's computed blocks land in HBM and, with offload, are written through below."""
        self._trim()
        parent = chain[hit_blocks - 1] if hit_blocks else None
        new = list(chain[hit_blocks:])
        p = parent
        for b in new:
            self._put(Tier.GPU, b, p, self.now)
            p = b
        if self.bh.tail_first:
            self._recent(Tier.GPU, chain)
        if not self.lower:
            return
        l1 = self.lower[0]
        if new and self._watermarked(l1):
            st = self.t[l1]
            fresh = [b for b in new if b not in st.lru]
            if len(st.lru) + len(fresh) > st.hw.capacity_blocks:  # allocation fails for the whole store
                self.store_failures += len(fresh)
                new = [b for b in new if b in st.lru]
        if new:
            e = self._copy(Tier.GPU, l1, new)
            for b in new:
                self._put(l1, b, None, e)
        if self.bh.touch_whole_prompt:
            self._recent(l1, chain)
        elif self.bh.tail_first:
            self._recent(l1, new)
        if not new:
            return
        for t in self.lower[1:]:
            keep = [b for b in new if b not in self.t[t].lru and
                    (self.disk_admission == "all" or self.freq[b] >= 2)]  # fmt: skip
            if keep:
                e2 = self._copy(l1, t, keep, e)
                for b in keep:
                    self._put(t, b, None, e2)

    # -- moves (the memory actuator) -----------------------------------------------------------------------
    def promote(self, b: int, to: Tier) -> str:
        """Copy ``b`` into ``to`` from the nearest slower tier holding it; '' when applied, else why not."""
        if to not in self.t or to is Tier.GPU:
            return "tier not managed by the layer"
        if b in self.t[to].lru:
            return "already there"
        src = next((t for t in self.order if t.rank > to.rank and b in self.t[t].lru), None)
        if src is None:
            return "not present"
        if self._watermarked(to) and len(self.t[to].lru) >= self.t[to].hw.capacity_blocks:
            return "tier full"  # the copy's allocation fails, as a store's does (LMCache MP L1)
        e = self._copy(src, to, [b], max(self.now, self.t[src].lru[b]))
        self._put(to, b, None, e)
        return ""

    def demote(self, b: int, to: Tier) -> str:
        src = next((t for t in self.lower if t.rank < to.rank and b in self.t[t].lru), None)
        if to not in self.t or src is None:
            return "not present"
        if b not in self.t[to].lru:
            e = self._copy(src, to, [b], max(self.now, self.t[src].lru[b]))
            self._put(to, b, None, e)
        self._drop(src, b)
        return ""

    def evict(self, b: int, tier: Tier | None) -> str:
        tiers = [tier] if tier is not None else list(self.lower)
        return "" if any([self._drop(t, b) for t in tiers if t in self.lower]) else "not present"

    def bytes_by_link(self) -> dict[str, int]:
        return {k: v.bytes_moved for k, v in sorted(self.links.items())}
