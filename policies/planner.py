"""Budgeted tier planner: observed placement + predicted reuse -> the moves worth making this tick.

Pure decision code (no I/O, no wall clock: ``now_s`` comes in on every call). Vectorised with numpy so a
tick over 1M tracked blocks stays within a few tens of milliseconds.

Value of holding a block at tier ``t`` (seconds of prefill saved, expected)::

    v_t = P(reuse) * (tokens * prefill_s_per_token - bytes / load_bandwidth_bytes_s[t])

and a move ``s -> t`` is worth ``v_t - v_s`` (``v`` of "not resident" is 0). Per tick the planner

1. honours the pinned set first: a pinned block is never demoted or evicted from its pin tier, and a pinned
   block not yet in its tier is promoted / admitted there ahead of everything else;
2. enforces watermarks: a tier above ``high_watermark * capacity`` sheds its lowest-value unpinned blocks
   down to ``low_watermark * capacity`` (``evict`` when a slower copy exists, else ``demote`` one tier down;
   never the last copy of a block);
3. fills free room below the high watermark with the highest-gain promotions / prefetches / admissions;
4. spends per tier-link token buckets (bytes/s and ops/s, refilled with the time since the last tick)
   on those moves, highest value first; what does not fit is deferred (counted), not planned.

Hysteresis: a block that was moved (``commit``) less than ``hysteresis_s`` ago is not moved again (pins:
``pin_retry_s``), and promotions need ``gain > min_gain_s``; together with the high/low watermark gap this
stops ping-pong.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvtier.policies.budget import TokenBucket
from kvtier.policies.inflight import InFlightMoves
from kvtier.policies.tiers import TIER_ORDER, Tier, TierSpec

Action = Literal["promote", "demote", "prefetch", "pin", "evict", "admit"]
ACTIONS: tuple[Action, ...] = ("promote", "demote", "prefetch", "pin", "evict", "admit")
NOWHERE = "none"  # link end for admissions (recompute / load from outside) and evictions


_BITS = {t: 1 << i for i, t in enumerate(TIER_ORDER)}
# residency mask -> rank of its fastest tier (len(TIER_ORDER) when empty), as a 256-entry lookup table
_FIRST_RANK = np.array(
    [next((r for r in range(len(TIER_ORDER)) if m >> r & 1), len(TIER_ORDER)) for m in range(256)], np.int8
)
_RANK = {t: i for i, t in enumerate(TIER_ORDER)}

# Candidate pruning (the ``lowest_*`` / ``highest_gain_*`` bounds below). Values only change speed, never
# which rows a tick picks: any probe of at least k rows gives a valid threshold.
# probe: the 4 k rows with the most extreme P of a sample; 4x oversampling keeps the k-th value among them
# close to the true k-th so the cut keeps few extra rows, at a cost still far below a full argpartition
_PROBE_MULT = 4
# sample: about 64 k rows strided over all of them, cheap to partition yet wide enough to hold 4 k rows
# representative of the whole set
_SAMPLE_MULT = 64
# relative widening of a cut on P: covers the rounding of theta / bound so the kept set stays a superset
_CUT_REL_SLACK = 1e-9
# absolute slack of the gain bounds, relative to the largest value: covers the rounding of a difference
_GAIN_REL_SLACK = 1e-12


def tier_bit(tier: Tier) -> int:
    """Bit of ``tier`` in a residency mask (gpu=1, cpu=2, disk=4, remote=8)."""
    return _BITS[tier]


@dataclass(frozen=True, slots=True)
class LinkBudget:
    """Quota of one tier link (``src->dst``): refill rates and bucket depth (``burst_s`` seconds of rate)."""

    bytes_per_s: float = 1e9
    ops_per_s: float = 100.0
    burst_s: float = 1.0


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Planner knobs; ``tiers`` are the managed tiers (any order; sorted fastest first; the planner reads
    their capacity, watermarks and load bandwidth)."""

    tiers: tuple[TierSpec, ...]
    budgets: Mapping[str, LinkBudget] = field(default_factory=dict)  # "cpu->gpu" -> budget
    default_budget: LinkBudget = LinkBudget()
    prefill_s_per_token: float = 2e-4  # engine prefill cost, seconds per token
    hysteresis_s: float = 30.0  # no second move of a block within this many seconds
    pin_retry_s: float = 5.0  # re-attempt an unmet pin after this many seconds
    min_gain_s: float = 0.0  # a promotion must gain more than this (expected seconds)
    reuse_threshold: float = 0.05  # promote / admit only when P(reuse) >= this
    max_candidates_per_tier: int = 4096  # bound on per-tier candidates ranked per tick (tick latency)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(sorted(self.tiers, key=lambda s: s.tier.rank)))
        if len({s.tier for s in self.tiers}) != len(self.tiers):
            raise ValueError("duplicate tier in planner config")

    def budget(self, link: str) -> LinkBudget:
        return self.budgets.get(link, self.default_budget)


@dataclass(frozen=True, slots=True)
class BlockView:
    """Observed state, one row per tracked block (all arrays the same length).

    ``tier_mask``: bit ``tier.rank`` set when a copy is resident there (see :func:`tier_bit`); 0 = tracked
    but not resident anywhere. ``tokens``: tokens of the prefix this block completes that a hit saves from
    prefill (block size for a plain block). ``nbytes``: KV bytes of the block. ``p_reuse``: predicted
    probability of reuse. ``admittable``: tokens are known, so the block can be re-created (warm-up).
    """

    hashes: npt.NDArray[np.int64]
    tier_mask: npt.NDArray[np.uint8]
    tokens: npt.NDArray[np.int32]
    nbytes: npt.NDArray[np.signedinteger[Any]]  # int32 or int64
    p_reuse: npt.NDArray[np.float32]
    admittable: npt.NDArray[np.bool_]
    lookup: Callable[[int], int] | None = None  # block -> row (-1 if absent); faster than a scan
    # vectorised ``lookup`` of int64 block keys (-1 where absent); preferred when set
    lookup_many: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]] | None = None
    # the index's slot epoch (row <-> block mappings taken under it stay valid); None = unknown
    epoch: object = None

    def rows_all(self, blocks: Collection[int]) -> npt.NDArray[np.int64]:
        """Row of each block, -1 where absent (aligned with ``blocks``)."""
        if self.lookup_many is not None:
            if isinstance(blocks, np.ndarray):
                return self.lookup_many(blocks.astype(np.int64, copy=False))
            return self.lookup_many(np.fromiter(blocks, np.int64, len(blocks)))
        if self.lookup is not None:
            get = self.lookup
            return np.fromiter((get(b) for b in blocks), np.int64, len(blocks))
        keys = np.fromiter(blocks, np.int64, len(blocks))
        if len(self) == 0:
            return np.full(len(keys), -1, np.int64)
        order = np.argsort(self.hashes, kind="stable")
        pos = np.searchsorted(self.hashes, keys, sorter=order)
        pos = np.minimum(pos, max(0, len(self) - 1))
        rows = order[pos]
        return np.where(self.hashes[rows] == keys, rows, -1).astype(np.int64)

    def rows_of(self, blocks: Collection[int]) -> npt.NDArray[np.int64]:
        """Rows of the given blocks that are in the view (absent ones dropped)."""
        if not blocks:
            return np.zeros(0, np.int64)
        if self.lookup_many is not None:
            rows = self.lookup_many(np.fromiter(blocks, np.int64, len(blocks)))
            return rows[rows >= 0]
        if self.lookup is not None:
            get = self.lookup
            rows = np.fromiter((get(b) for b in blocks), np.int64, len(blocks))
            return rows[rows >= 0]
        return np.flatnonzero(np.isin(self.hashes, np.fromiter(blocks, np.int64, len(blocks))))

    def __len__(self) -> int:
        return int(self.hashes.shape[0])

    @staticmethod
    def empty() -> BlockView:
        return BlockView(
            np.zeros(0, np.int64),
            np.zeros(0, np.uint8),
            np.zeros(0, np.int32),
            np.zeros(0, np.int64),
            np.zeros(0, np.float32),
            np.zeros(0, np.bool_),
        )


@dataclass(frozen=True, slots=True)
class Move:
    """One planned tier change. ``src``/``dst`` None = outside the tiers (admit from recompute, evict)."""

    action: Action
    block: int
    src: Tier | None
    dst: Tier | None
    value_s: float  # expected seconds saved (>0) or lost (<0) by the move
    nbytes: int
    pinned: bool = False

    @property
    def link(self) -> str:
        return f"{self.src.value if self.src else NOWHERE}->{self.dst.value if self.dst else NOWHERE}"


@dataclass(slots=True)
class Plan:
    """Planner output: moves within budget (highest value first per class) and why others were not."""

    moves: list[Move] = field(default_factory=list)
    tried: Counter[str] = field(default_factory=Counter)  # action -> candidates that qualified
    deferred: Counter[str] = field(default_factory=Counter)  # action -> cut by link budget
    held: Counter[str] = field(default_factory=Counter)  # reason -> blocks held (hysteresis, pin, last copy)
    tier_usage: dict[str, int] = field(default_factory=dict)  # tier -> resident blocks observed


class Planner:
    """Stateful only in its token buckets and the committed moves (both fed by the caller's clock)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._buckets: dict[str, TokenBucket] = {}
        # each block's latest committed move (time, bits it clears / sets) as arrays: the in-flight pass
        self._inflight = InFlightMoves()

    def reconfigure(self, config: PlannerConfig) -> None:
        """Swap the config at a tick boundary (buckets are kept, clipped to the new depth)."""
        self.config = config

    # -- budgets -----------------------------------------------------------------------------------------
    def _bucket(self, link: str, now_s: float) -> TokenBucket:
        """The link's bucket (amount = bytes), refilled to ``now_s``."""
        b = self.config.budget(link)
        bk = self._buckets.get(link)
        if bk is None:
            bk = self._buckets[link] = TokenBucket.full(b.bytes_per_s, b.ops_per_s, b.burst_s, now_s)
        bk.refill(now_s, b.bytes_per_s, b.ops_per_s, b.burst_s)
        return bk

    def budget_state(self) -> dict[str, dict[str, float]]:
        """Remaining quota per link (bytes, ops) as of the last tick."""
        return {k: {"bytes": v.amount, "ops": v.ops} for k, v in self._buckets.items()}

    # -- hysteresis ----------------------------------------------------------------------------------------
    def commit(self, moves: Iterable[Move], now_s: float) -> None:
        """Record that ``moves`` were emitted at ``now_s`` (applied, or recorded as shadow decisions).

        Until observed state catches up (at most ``hysteresis_s``; pins ``pin_retry_s``) the planner assumes
        their effect, so re-planning the same state is a no-op and a block is not moved again."""
        blocks, clear, put = [], [], []
        for m in moves:
            blocks.append(m.block)
            clear.append(_BITS[m.src] if m.action in ("demote", "evict") and m.src is not None else 0)
            put.append(_BITS[m.dst] if m.dst is not None and m.action != "evict" else 0)
        self._inflight.record_many(blocks, now_s, clear, put)
        horizon = now_s - max(self.config.hysteresis_s, self.config.pin_retry_s)
        self._inflight.expire(horizon)

    def _in_flight(
        self, view: BlockView, now_s: float
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.uint8]]:
        """Rows moved within the hysteresis window, and the tier mask with those moves assumed done."""
        n = len(view)
        mask = view.tier_mask
        recent = np.zeros(n, np.bool_)
        if not len(self._inflight):
            return recent, mask
        rows, clear, put = self._inflight.live_rows(
            now_s - self.config.hysteresis_s, view.hashes, view.rows_all, view.epoch
        )
        if rows.size == 0:
            return recent, mask
        recent[rows] = True
        mask = mask.copy()
        mask[rows] = (mask[rows] & ~clear) | put
        return recent, mask

    # -- planning ------------------------------------------------------------------------------------------
    def value(self, view: BlockView, tier: Tier) -> npt.NDArray[np.float64]:
        """Expected seconds saved by holding each block at ``tier`` (formula in the module docstring)."""
        spec = self._spec(tier)
        bw = spec.load_bandwidth_bytes_s if spec else 1e10
        saved = view.tokens.astype(np.float64) * self.config.prefill_s_per_token
        return view.p_reuse.astype(np.float64) * (saved - view.nbytes.astype(np.float64) / bw)

    def _spec(self, tier: Tier) -> TierSpec | None:
        for s in self.config.tiers:
            if s.tier is tier:
                return s
        return None

    def plan(
        self,
        view: BlockView,
        now_s: float,
        *,
        pins: Mapping[int, Tier] | None = None,
        pinned_at_layer: Collection[int] = (),
        pin_admittable: Collection[int] = (),
        allowed: Collection[str] | None = None,
        desired: Mapping[Tier, npt.NDArray[np.bool_]] | None = None,
    ) -> Plan:
        """Plan this tick's moves.

        ``pins``: block -> tier it must stay in (or faster). ``pinned_at_layer``: pins the cache layer already
        acknowledged (no ``pin`` action needed). ``pin_admittable``: pinned blocks not in ``view`` whose
        tokens are known (they can be admitted). ``allowed``: actions to consider (None = all).
        ``desired``: tier -> per-row mask of the blocks a placement policy holds there. Such a tier is not
        run on watermarks and value: its moves are the diff of the mask against the observed placement
        (with in-flight moves assumed done, so no ping-pong guard beyond the policy's own): rows held but
        absent are admitted / promoted, rows present but not held are evicted (another copy exists) or
        demoted one managed tier down (never the last copy). Pins still win; link budgets still apply.
        """
        cfg = self.config
        pins = pins or {}
        plan = Plan()
        n = len(view)
        specs = cfg.tiers
        recent, tier_mask = self._in_flight(view, now_s)
        promoted = np.zeros(n, np.bool_)  # rows already given an up-move this tick
        pinned_rows = np.zeros(n, np.bool_)
        pinned_rows[view.rows_of(pins.keys())] = True

        candidates: list[tuple[int, float, Move]] = []  # (class, sort key, move); 0 pin, 1 shed, 2 gain
        # 1. pins
        pin_moves = self._plan_pins(view, now_s, pins, pinned_at_layer, pin_admittable, tier_mask, plan)
        candidates.extend((0, -m.value_s, m) for m in pin_moves)
        bw = self._bw_by_rank()
        ops_cap = self._ops_cap()
        tok_const = _broadcast_value(view.tokens)
        made: list[ValueBounds] = []

        def bounds() -> ValueBounds:
            """The view's value bounds (two passes over the sizes: built once per plan, when needed)."""
            if not made:
                made.append(ValueBounds(view, bw, cfg.prefill_s_per_token))
            return made[0]

        def val(rows: npt.NDArray[np.intp], rank: int | npt.NDArray[np.int8]) -> npt.NDArray[np.float64]:
            """v at tier ``rank`` for ``rows`` (rank 4 = not resident: 0)."""
            # p * (tokens * prefill_s_per_token - nbytes / bw), in place (same operations, same rounding)
            out = view.p_reuse.take(rows).astype(np.float64)
            if tok_const is not None:  # the loop's tokens: one value broadcast to every row
                saved = np.full(len(rows), tok_const)
            else:
                saved = view.tokens.take(rows).astype(np.float64)
            saved *= cfg.prefill_s_per_token
            load = view.nbytes.take(rows).astype(np.float64)
            load /= bw[rank]
            saved -= load
            out *= saved
            if not isinstance(rank, int):
                out[rank == len(TIER_ORDER)] = 0.0
            elif rank == len(TIER_ORDER):
                out[:] = 0.0
            return out

        # 2. watermarks: shed lowest-value blocks from tiers above their high watermark.
        room: dict[Tier, int] = {}
        for i, spec in enumerate(specs):
            bit = tier_bit(spec.tier)
            count = int(np.count_nonzero(tier_mask & bit))
            plan.tier_usage[spec.tier.value] = count
            if desired is not None and spec.tier in desired:
                room[spec.tier] = 0  # the policy fills it: no value-based fill below
                candidates.extend(
                    self._plan_desired(
                        view, i, desired[spec.tier], tier_mask, pins, pinned_rows, val, bounds, plan
                    )
                )
                continue
            cap = spec.capacity_blocks
            high, low = int(spec.high_watermark * cap), int(spec.low_watermark * cap)
            if count <= high:
                room[spec.tier] = high - count
                continue
            room[spec.tier] = 0
            need = count - low
            # a mask until the value bounds have cut it down (the tier can hold 100k+ rows)
            cand_m = (tier_mask & bit) != 0
            if pins:
                pr = np.flatnonzero(cand_m & pinned_rows)
                prot = pr[_held_by_pins(pr, spec.tier, view, pins, pinned_rows)]
                plan.held["pinned"] += int(prot.size)
                cand_m[prot] = False
            rec = cand_m & recent
            plan.held["hysteresis"] += int(np.count_nonzero(rec))
            cand_m ^= rec
            n_cand, rank = int(np.count_nonzero(cand_m)), spec.tier.rank
            if n_cand == 0:
                continue
            kk = min(need, cfg.max_candidates_per_tier, ops_cap)
            if n_cand > 8 * kk:  # only rows that can be among the kk lowest values (exact)
                cand = bounds().lowest_in_mask(cand_m, n_cand, kk, rank, functools.partial(val, rank=rank))
            else:
                cand = np.flatnonzero(cand_m)
            v_here = val(cand, rank)
            take = _smallest(v_here, kk)
            order, v_order = cand[take], v_here[take]
            slower_bits = sum(tier_bit(sp.tier) for sp in specs[i + 1 :])
            nxt = specs[i + 1].tier if i + 1 < len(specs) else None
            v_next = val(order, nxt.rank) if nxt is not None else np.zeros(order.size)
            n_evict = n_demote = 0
            for j, r in enumerate(order.tolist()):
                h = int(view.hashes[r])
                if int(tier_mask[r]) & slower_bits:
                    m = Move("evict", h, spec.tier, None, -float(v_order[j]), int(view.nbytes[r]))
                    n_evict += 1
                elif nxt is not None:
                    m = Move("demote", h, spec.tier, nxt, -float(v_order[j] - v_next[j]), int(view.nbytes[r]))
                    n_demote += 1
                else:
                    plan.held["last_copy"] += 1
                    continue
                candidates.append((1, -m.value_s, m))
            beyond = min(need, n_cand) - order.size  # qualified but past the per-tick cap
            if beyond > 0:
                plan.tried["demote" if nxt is not None else "evict"] += beyond
                plan.deferred["demote" if nxt is not None else "evict"] += beyond

        # 3. promotions / prefetches / admissions into free room, highest gain first.
        up: UpMoves | None = None  # which rows may move up (built lazily, once)
        for spec in specs:
            free = room.get(spec.tier, 0)
            if free <= 0:
                continue
            # cheap pre-check (uint8 passes): any row without a copy this fast that could move up?
            faster = np.uint8((1 << (spec.tier.rank + 1)) - 1)
            movable = (tier_mask & faster) == 0
            movable &= (tier_mask != 0) | view.admittable
            if not movable.any():
                continue  # no candidate for this tier (the eligibility passes would find none)
            if up is None:
                up = UpMoves(
                    view, tier_mask, recent, pinned_rows, promoted, cfg.reuse_threshold, specs[0].tier
                )
            k = min(free, cfg.max_candidates_per_tier, ops_cap)
            cand, cand_rank, n_qual = up.candidates(spec.tier.rank, k, free, val, bounds, cfg.min_gain_s)
            if cand.size == 0:
                continue
            gain = val(cand, spec.tier.rank) - val(cand, cand_rank)
            good = gain > cfg.min_gain_s
            cand, gain, cand_rank = cand[good], gain[good], cand_rank[good]
            if cand.size == 0:
                continue
            take = _largest(gain, k)
            order, g_order, o_rank = cand[take], gain[take], cand_rank[take]
            for j, r in enumerate(order.tolist()):
                src_rank = int(o_rank[j])
                src = TIER_ORDER[src_rank] if src_rank < len(TIER_ORDER) else None
                if src is None:
                    action: Action = "admit"
                elif spec.tier is Tier.GPU:
                    action = "prefetch"
                else:
                    action = "promote"
                m = Move(action, int(view.hashes[r]), src, spec.tier, float(g_order[j]), int(view.nbytes[r]))
                candidates.append((2, -m.value_s, m))
            beyond = min(free, n_qual) - order.size
            if beyond > 0:
                a = "prefetch" if spec.tier is Tier.GPU else "promote"
                plan.tried[a] += beyond
                plan.deferred[a] += beyond
            # the same block must not be promoted into two tiers in one tick
            promoted[order] = True

        # 4. spend the link budgets: class first (pins, shedding, gains), then highest value.
        candidates.sort(key=lambda c: (c[0], c[1]))
        # each link's bucket is refilled once per plan (a refill at the same now_s changes nothing)
        refilled: dict[tuple[Tier | None, Tier | None], TokenBucket] = {}
        for _, _, m in candidates:
            if allowed is not None and m.action not in allowed:
                continue
            plan.tried[m.action] += 1
            bk = refilled.get((m.src, m.dst))
            if bk is None:
                bk = refilled[(m.src, m.dst)] = self._bucket(m.link, now_s)
            if not bk.take(m.nbytes):
                plan.deferred[m.action] += 1
                continue
            plan.moves.append(m)
        return plan

    def _plan_desired(
        self,
        view: BlockView,
        i: int,
        want: npt.NDArray[np.bool_],
        tier_mask: npt.NDArray[np.uint8],
        pins: Mapping[int, Tier],
        pinned_rows: npt.NDArray[np.bool_],
        val: Callable[[npt.NDArray[np.intp], int | npt.NDArray[np.int8]], npt.NDArray[np.float64]],
        value_bounds: Callable[[], ValueBounds],
        plan: Plan,
    ) -> list[tuple[int, float, Move]]:
        """Moves that make tier ``specs[i]`` equal to ``want`` (see :meth:`plan`), as planner candidates."""
        specs = self.config.tiers
        spec = specs[i]
        bit = tier_bit(spec.tier)
        here = (tier_mask & bit) != 0
        out: list[tuple[int, float, Move]] = []
        k_max = min(self.config.max_candidates_per_tier, self._ops_cap())  # per-tick bound (tick latency)
        # drop what the policy no longer holds, lowest value first. Both sides stay masks until the
        # value bounds have cut them down: the policy's diff can be 100k+ rows where k_max moves fit
        shed_m = here & ~want
        if pins:
            pr = np.flatnonzero(shed_m & pinned_rows)
            if pr.size:
                keep = _held_by_pins(pr, spec.tier, view, pins, pinned_rows)
                plan.held["pinned"] += int(keep.sum())
                shed_m[pr[keep]] = False
        fill_m = want & ~here
        fill_m &= ~pinned_rows
        n_shed, n_fill = int(np.count_nonzero(shed_m)), int(np.count_nonzero(fill_m))
        bounds = None
        if max(n_shed, n_fill) > 8 * k_max:
            bounds = value_bounds()
        if n_shed:
            rank = spec.tier.rank
            if n_shed > k_max:
                self._beyond(plan, "evict", n_shed - k_max)
                if bounds is not None:  # only rows that can be among the k_max lowest values (exact)
                    shed = bounds.lowest_in_mask(shed_m, n_shed, k_max, rank, lambda r: val(r, rank))
                else:
                    shed = np.flatnonzero(shed_m)
                v_here = val(shed, rank)
                take = _smallest(v_here, k_max)
                shed, v_here = shed[take], v_here[take]
            else:
                shed = np.flatnonzero(shed_m)
                v_here = val(shed, rank)
            nxt = specs[i + 1].tier if i + 1 < len(specs) else None
            v_next = val(shed, nxt.rank) if nxt is not None else np.zeros(shed.size)
            other = tier_mask[shed] & ~np.uint8(bit)
            for j, r in enumerate(shed.tolist()):
                h, nb = int(view.hashes[r]), int(view.nbytes[r])
                if other[j]:
                    m = Move("evict", h, spec.tier, None, -float(v_here[j]), nb)
                elif nxt is not None:
                    m = Move("demote", h, spec.tier, nxt, -float(v_here[j] - v_next[j]), nb)
                else:
                    plan.held["last_copy"] += 1
                    continue
                out.append((1, -m.value_s, m))
        # add what it holds: promote from a slower copy, else admit (stored from the engine / recomputed)
        if n_fill:
            slower_bits = np.uint8(~((bit << 1) - 1) & 0xFF)

            def gain_of(rows: npt.NDArray[np.intp]) -> npt.NDArray[np.float64]:
                return val(rows, spec.tier.rank) - val(rows, _FIRST_RANK[tier_mask[rows] & slower_bits])

            if n_fill > k_max and bounds is not None:  # only rows that can be among the k_max best
                fill = bounds.highest_gain_in_mask(fill_m, n_fill, k_max, spec.tier.rank, tier_mask, gain_of)
            else:
                fill = np.flatnonzero(fill_m)
            src_rank = _FIRST_RANK[tier_mask[fill] & slower_bits]
            gain = val(fill, spec.tier.rank) - val(fill, src_rank)
            if n_fill > k_max:
                self._beyond(plan, "admit", n_fill - k_max)
                take = _largest(gain, k_max)
                fill, gain, src_rank = fill[take], gain[take], src_rank[take]
            for j, r in enumerate(fill.tolist()):
                sr = int(src_rank[j])
                src = TIER_ORDER[sr] if sr < len(TIER_ORDER) else None
                action: Action = "promote" if spec.tier is not Tier.GPU else "prefetch"
                if src is None:
                    action = "admit"
                m = Move(action, int(view.hashes[r]), src, spec.tier, float(gain[j]), int(view.nbytes[r]))
                out.append((2, -m.value_s, m))
        return out

    def _bw_by_rank(self) -> npt.NDArray[np.float64]:
        """Load bandwidth per tier rank (unmanaged ranks: the slowest managed one), as in :meth:`plan`."""
        specs = self.config.tiers
        bw = np.full(len(TIER_ORDER) + 1, min((sp.load_bandwidth_bytes_s for sp in specs), default=1e10))
        for sp in specs:
            bw[sp.tier.rank] = sp.load_bandwidth_bytes_s
        return bw

    @staticmethod
    def _beyond(plan: Plan, action: str, n: int) -> None:
        """``n`` qualified moves past the per-tick candidate bound: tried and deferred."""
        plan.tried[action] += n
        plan.deferred[action] += n

    def _ops_cap(self) -> int:
        """Most moves any one link could afford in a tick (bounds the candidates materialised per tier)."""
        budgets = [self.config.default_budget, *self.config.budgets.values()]
        return max(1, int(max(b.ops_per_s * b.burst_s for b in budgets)) + 1)

    def _plan_pins(
        self,
        view: BlockView,
        now_s: float,
        pins: Mapping[int, Tier],
        pinned_at_layer: Collection[int],
        pin_admittable: Collection[int],
        tier_mask: npt.NDArray[np.uint8],
        plan: Plan,
    ) -> list[Move]:
        if not pins:
            return []
        out: list[Move] = []
        rows = view.rows_of(pins.keys())
        row_of = {int(view.hashes[r]): int(r) for r in rows}
        acked = set(pinned_at_layer)
        admittable = set(pin_admittable)
        for h, tier in pins.items():
            last = self._inflight.at_of(h)
            if last is not None and now_s - last < self.config.pin_retry_s:
                plan.held["pin_in_flight"] += 1
                continue
            r = row_of.get(h)
            if r is None:
                if h in admittable:
                    out.append(Move("admit", h, None, tier, float("inf"), 0, pinned=True))
                else:
                    plan.held["pin_unknown_tokens"] += 1
                continue
            rank = int(_FIRST_RANK[int(tier_mask[r])])
            nbytes = int(view.nbytes[r])
            if rank <= tier.rank:
                if h not in acked:
                    out.append(Move("pin", h, tier, tier, float("inf"), 0, pinned=True))
                continue
            if rank == len(TIER_ORDER):
                if not view.admittable[r] and h not in admittable:
                    plan.held["pin_unknown_tokens"] += 1
                    continue
                out.append(Move("admit", h, None, tier, float("inf"), nbytes, pinned=True))
            else:
                action: Action = "prefetch" if tier is Tier.GPU else "promote"
                out.append(Move(action, h, TIER_ORDER[rank], tier, float("inf"), nbytes, pinned=True))
        return out


class UpMoves:
    """Which rows may move up into a tier this tick (promote / prefetch / admit), and a bounded candidate
    set per tier that holds its ``k`` highest gains. A row qualifies with ``P >= reuse_threshold``, a copy
    somewhere or its tokens known (admittable), no copy in the fastest managed tier, not in flight, not
    pinned, not already moved up this tick, and no copy in the target tier or faster."""

    def __init__(
        self,
        view: BlockView,
        tier_mask: npt.NDArray[np.uint8],
        recent: npt.NDArray[np.bool_],
        pinned_rows: npt.NDArray[np.bool_],
        promoted: npt.NDArray[np.bool_],
        threshold: float,
        top: Tier,
    ) -> None:
        self.view, self.tier_mask, self.recent, self.pinned, self.promoted = (
            view, tier_mask, recent, pinned_rows, promoted,
        )  # fmt: skip
        self.threshold = threshold
        self.top_bit = np.uint8(tier_bit(top))

    def exact(
        self, rows: npt.NDArray[np.intp], rank: int
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int8]]:
        """The qualifying subset of ``rows`` for a tier of ``rank``, and each one's fastest copy's rank."""
        v, tm = self.view, self.tier_mask[rows]
        ok = v.p_reuse[rows] >= self.threshold
        ok &= (tm != 0) | v.admittable[rows]
        ok &= (tm & self.top_bit) == 0
        ok &= ~self.recent[rows]
        ok &= ~self.pinned[rows]
        ok &= ~self.promoted[rows]
        src = _FIRST_RANK[tm]
        ok &= src > rank
        return rows[ok], src[ok]

    def _qualifying(self, rank: int) -> npt.NDArray[np.bool_]:
        """:meth:`exact` as a mask over every row (bool passes, no gathers)."""
        v, tm = self.view, self.tier_mask
        ok = v.p_reuse >= self.threshold
        ok &= (tm != 0) | v.admittable
        ok &= (tm & (self.top_bit | np.uint8((1 << (rank + 1)) - 1))) == 0
        ok &= ~self.recent
        ok &= ~self.pinned
        ok &= ~self.promoted
        return ok

    def count(self, rank: int) -> int:
        """How many rows qualify for a tier of ``rank``."""
        return int(np.count_nonzero(self._qualifying(rank)))

    def candidates(
        self,
        rank: int,
        k: int,
        free: int,
        val: Callable[[npt.NDArray[np.intp], int | npt.NDArray[np.int8]], npt.NDArray[np.float64]],
        bounds: Callable[[], ValueBounds],
        min_gain_s: float,
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int8], int]:
        """Qualifying rows for a tier of ``rank`` (with their source ranks) that include the ``k`` highest
        gains, and ``n`` with ``min(free, n) == min(free, qualifying rows)`` (the tried / deferred count).

        A strided probe of ~64 k rows gives a threshold: the k-th highest gain among its qualifying rows.
        A row's gain is at most ``P x b`` (:meth:`ValueBounds.gain_bounds`; one ``b`` for rows with a
        copy, one for admissions), so a few passes over P and the tier bits keep every row that can reach
        it, and only those are checked exactly. Without a usable
        probe (too few qualifying rows in it, a negative threshold) the full pass instead, with the
        likeliest 4k per source tier (equal block sizes: the gain grows with P within one)."""
        v = self.view
        n = len(v)
        if self.threshold >= 0.0 and n > 64 * k:
            probe = np.arange(0, n, n // (64 * k), dtype=np.intp)
            rows, src = self.exact(probe, rank)
            b_res, b_adm = bounds().gain_bounds(rank)
            if rows.size >= k and max(b_res, b_adm) > 0.0:
                g = val(rows, rank) - val(rows, src)
                theta = max(float(np.partition(g, rows.size - k)[rows.size - k]), min_gain_s)
                if theta > 0.0:
                    # P x b >= theta, b for a copy elsewhere or for an admission (rounding slack: keep)
                    near = (1.0 - 1e-9) * theta
                    keep = v.p_reuse >= near / b_res if b_res > 0.0 else np.zeros(n, np.bool_)
                    if b_adm > b_res:  # admissions (no copy, tokens known) can reach it with a lower P
                        adm = v.p_reuse >= near / b_adm
                        adm &= self.tier_mask == 0
                        adm &= v.admittable
                        keep |= adm
                    rows, src = self.exact(np.flatnonzero(keep), rank)
                    # then each by its own source's bound (a copy in a faster tier saves less)
                    reach = v.p_reuse[rows] * bounds().source_gain_bounds(rank)[src] >= near
                    rows, src = rows[reach], src[reach]
                    # >= k qualify: with k = free that settles min(free, n); else count them all
                    return rows, src, max(rows.size, k) if k >= free else self.count(rank)
        cand = np.flatnonzero(self._qualifying(rank))
        cand_rank = _FIRST_RANK[self.tier_mask[cand]]  # fastest resident tier of each; 4 = none
        n_qual = int(cand.size)
        if cand.size > 8 * k:
            groups: list[npt.NDArray[np.intp]] = []
            for r in range(rank + 1, len(TIER_ORDER) + 1):
                grp = np.flatnonzero(cand_rank == r)
                if grp.size > 4 * k:
                    grp = grp[np.argpartition(-v.p_reuse[cand[grp]], 4 * k - 1)[: 4 * k]]
                groups.append(grp)
            pick = np.sort(np.concatenate(groups))
            cand, cand_rank = cand[pick], cand_rank[pick]
        return cand, cand_rank, n_qual


class ValueBounds:
    """Exact pruning for top-k selections over many rows (tick latency: only a few hundred moves fit the
    budgets, but the candidates can be 100k+ rows). A row's value at rank ``t`` is
    ``p * (tokens * c - nbytes / bw[t])`` (``c`` = prefill seconds per token) and a fill's gain the
    difference of two such values, so with ``p >= 0`` both are bounded by ``p`` times a constant from the
    view's extreme ``tokens`` / ``nbytes``. The exact values of the 4k likeliest (or least likely) rows give
    a threshold; only rows whose bound can reach it are kept. The selected top-k is the same as over all
    rows (up to the order of exactly equal values, which is arbitrary in either case)."""

    def __init__(self, view: BlockView, bw: npt.NDArray[np.float64], prefill_s_per_token: float) -> None:
        self.p = view.p_reuse
        self.bw = bw
        self.c = prefill_s_per_token
        tok, one = view.tokens, _broadcast_value(view.tokens)
        if one is not None:
            self.tok_min = self.tok_max = one
        else:
            self.tok_min = float(tok.min()) if len(view) else 0.0
            self.tok_max = float(tok.max()) if len(view) else 0.0
        self.nb_min = float(view.nbytes.min()) if len(view) else 0.0
        self.nb_max = float(view.nbytes.max()) if len(view) else 0.0
        self._pnn: bool | None = None

    def _p(self, rows: npt.NDArray[np.intp]) -> npt.NDArray[np.floating[Any]] | None:
        pr = self.p.take(rows)  # (the view's float32: products with float64 arrays are exact float64)
        return pr if bool((pr >= 0.0).all()) else None  # NaN / negative: no bound, keep every row

    def lowest_candidates(
        self,
        rows: npt.NDArray[np.intp],
        k: int,
        rank: int,
        value: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.float64]],
    ) -> npt.NDArray[np.intp]:
        """Rows (a subset of ``rows``, same order) that can be among the ``k`` lowest values at ``rank``."""
        pr = self._p(rows)
        # value >= p * a_lo (floating-point monotone: tokens >= tok_min, nbytes <= nb_max)
        a_lo = self.tok_min * self.c - self.nb_max / float(self.bw[rank])
        if pr is None or a_lo <= 0.0 or rows.size <= _PROBE_MULT * k:
            return rows
        # the probe: the least likely rows of a strided sample (any k+ rows give a valid threshold; the
        # sample's keep it tight at a fraction of the cost, and of the worst cases, of a full argpartition)
        sample = np.arange(0, rows.size, max(1, rows.size // (_SAMPLE_MULT * k)))
        probe = (
            sample[np.argpartition(pr[sample], _PROBE_MULT * k)[: _PROBE_MULT * k]]
            if sample.size > _PROBE_MULT * k
            else sample
        )
        theta = float(np.partition(value(rows[probe]), k - 1)[k - 1])  # k-th lowest value among them
        # p * a_lo <= theta, as one comparison in P's own type against a cut rounded up (keeps a superset)
        cut = np.nextafter(pr.dtype.type(theta / a_lo * (1.0 + _CUT_REL_SLACK)), pr.dtype.type(np.inf))
        return rows[pr <= cut]

    def _p_nonneg(self) -> bool:
        """P is >= 0 on every row (no NaN): a bound may be applied to a whole mask (checked once)."""
        if self._pnn is None:
            self._pnn = bool((self.p >= 0.0).all())
        return self._pnn

    @staticmethod
    def _mask_sample(mask: npt.NDArray[np.bool_], count: int, k: int) -> npt.NDArray[np.intp]:
        """About ``_SAMPLE_MULT * k`` of the ``count`` rows set in ``mask``, strided (ascending)."""
        pos = np.arange(0, mask.shape[0], max(1, count // (_SAMPLE_MULT * k)), dtype=np.intp)
        return pos[mask[pos]]

    def lowest_in_mask(
        self,
        mask: npt.NDArray[np.bool_],
        count: int,
        k: int,
        rank: int,
        value: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.float64]],
    ) -> npt.NDArray[np.intp]:
        """:meth:`lowest_candidates` of ``np.flatnonzero(mask)`` (``count`` rows), without listing them all:
        the probe is a strided sample of the mask and the cut one pass over P (the same comparison)."""
        a_lo = self.tok_min * self.c - self.nb_max / float(self.bw[rank])
        if count > _PROBE_MULT * k and a_lo > 0.0 and self._p_nonneg():
            sample = self._mask_sample(mask, count, k)
            if sample.size >= k:
                ps = self.p.take(sample)
                probe = (
                    sample[np.argpartition(ps, _PROBE_MULT * k)[: _PROBE_MULT * k]]
                    if sample.size > _PROBE_MULT * k
                    else sample
                )
                theta = float(np.partition(value(probe), k - 1)[k - 1])  # >= the k-th lowest of the mask
                cut = np.nextafter(
                    self.p.dtype.type(theta / a_lo * (1.0 + _CUT_REL_SLACK)), self.p.dtype.type(np.inf)
                )
                keep = self.p <= cut
                keep &= mask
                return np.flatnonzero(keep)
        return self.lowest_candidates(np.flatnonzero(mask), k, rank, value)

    def highest_gain_in_mask(
        self,
        mask: npt.NDArray[np.bool_],
        count: int,
        k: int,
        rank: int,
        tier_mask: npt.NDArray[np.uint8],
        gain: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.float64]],
    ) -> npt.NDArray[np.intp]:
        """:meth:`highest_gain_candidates` of ``np.flatnonzero(mask)`` (``count`` rows; sources from
        ``tier_mask``) without listing them all: a strided sample gives the threshold, one pass over P
        against the largest source bound keeps a superset, which is then cut by each row's own bound."""
        slower = np.uint8(~((1 << (rank + 1)) - 1) & 0xFF)
        if count > _PROBE_MULT * k and self._p_nonneg():
            sample = self._mask_sample(mask, count, k)
            if sample.size >= k:
                b = self.source_gain_bounds(rank)
                bs = self.p.take(sample) * b[_FIRST_RANK[tier_mask[sample] & slower]]
                probe = (
                    sample[np.argpartition(-bs, _PROBE_MULT * k)[: _PROBE_MULT * k]]
                    if sample.size > _PROBE_MULT * k
                    else sample
                )
                theta = float(-np.partition(-gain(probe), k - 1)[k - 1])  # <= the k-th highest of the mask
                if not theta > 0.0:
                    return np.flatnonzero(mask)
                b_max = float(b[rank + 1 :].max())
                if not b_max > 0.0:
                    return np.zeros(0, np.intp)  # no row's gain can be positive
                # p * b_max >= p * b[src] >= theta: a cut on P alone, rounded down (keeps a superset)
                ft = self.p.dtype.type
                cut = np.nextafter(ft(theta / b_max * (1.0 - _CUT_REL_SLACK)), ft(-np.inf))
                keep = self.p >= cut
                keep &= mask
                rows = np.flatnonzero(keep)
                bound = self.p.take(rows) * b[_FIRST_RANK[tier_mask[rows] & slower]]
                return rows[bound >= theta]
        rows = np.flatnonzero(mask)
        return self.highest_gain_candidates(rows, _FIRST_RANK[tier_mask[rows] & slower], k, rank, gain)

    def highest_gain_candidates(
        self,
        rows: npt.NDArray[np.intp],
        src_rank: npt.NDArray[np.int8],
        k: int,
        rank: int,
        gain: Callable[[npt.NDArray[np.intp]], npt.NDArray[np.float64]],
    ) -> npt.NDArray[np.intp]:
        """Rows that can be among the ``k`` highest fill ``gain`` into ``rank``; ``src_rank``: each row's
        fastest copy (``len(TIER_ORDER)`` = none: an admission)."""
        pr = self._p(rows)
        if pr is None or rows.size <= _PROBE_MULT * k:
            return rows
        bound = pr * self.source_gain_bounds(rank)[src_rank]
        probe = np.argpartition(-bound, _PROBE_MULT * k)[: _PROBE_MULT * k]  # highest bounds
        theta = float(-np.partition(-gain(rows[probe]), k - 1)[k - 1])  # k-th highest gain among them
        if not theta > 0.0:
            return rows
        return rows[bound >= theta]

    def source_gain_bounds(self, rank: int) -> npt.NDArray[np.float64]:
        """Per source rank ``s``, ``b[s]`` with fill gain into ``rank`` <= ``p * b[s]`` (``p >= 0``): from
        nowhere (``s = len(TIER_ORDER)``) the whole value at ``rank``, from a slower copy the load time
        saved; plus slack for the rounding of a difference of two values."""
        c, bw = self.c, self.bw
        inv_t = 1.0 / float(bw[rank])
        slack = _GAIN_REL_SLACK * (self.tok_max * c + self.nb_max / float(bw.min()))
        b = np.array([self.nb_max * max(0.0, 1.0 / float(x) - inv_t) for x in bw]) + slack
        b[len(TIER_ORDER)] = self.tok_max * c - self.nb_min * inv_t + slack
        return b

    def gain_bounds(self, rank: int) -> tuple[float, float]:
        """``(b_copy, b_admit)``: gain <= ``p * b_copy`` for a fill into ``rank`` from any slower copy,
        ``p * b_admit`` for an admission (no copy); 0 where no such source exists."""
        b = self.source_gain_bounds(rank)
        return float(b[rank + 1 : len(TIER_ORDER)].max(initial=0.0)), float(b[len(TIER_ORDER)])


def _broadcast_value(a: npt.NDArray[Any]) -> float | None:
    """The single value of a non-empty 1-D array broadcast to every row (the loop's token column), else
    None (then a gather or a reduction is needed)."""
    return float(a[0]) if a.shape[0] and a.strides == (0,) else None


def _held_by_pins(
    rows: npt.NDArray[np.intp],
    tier: Tier,
    view: BlockView,
    pins: Mapping[int, Tier],
    pinned_rows: npt.NDArray[np.bool_],
) -> npt.NDArray[np.bool_]:
    """Which of ``rows`` a pin keeps in ``tier``: pinned to it or to a slower tier (bool per row)."""
    out = np.zeros(rows.size, np.bool_)
    if not pins:
        return out
    j = np.flatnonzero(pinned_rows[rows])
    if j.size:
        rank = np.array([pins.get(int(h), Tier.REMOTE).rank for h in view.hashes[rows[j]].tolist()], np.int64)
        out[j[rank >= tier.rank]] = True
    return out


def _smallest(values: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.intp]:
    """Indices of the ``k`` smallest values, ascending (ties by position: deterministic)."""
    if k >= values.shape[0]:
        return np.argsort(values, kind="stable")
    part = np.argpartition(values, k)[:k]
    return part[np.argsort(values[part], kind="stable")]


def _largest(values: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.intp]:
    """Indices of the ``k`` largest values, descending."""
    return _smallest(-values, k)
