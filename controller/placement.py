"""The configured placement :class:`~kvtier.policies.base.Policy` inside the live loop (``--policy NAME``).

The same objects replay drives: every inferred request
(:class:`~kvtier.collectors.kv_requests.RequestInferrer`: KV events, or trace requests in shadow replay)
goes to ``policy.access`` in arrival order, with ``drain_evicted()`` after each one, exactly like
:func:`kvtier.replay.engine.replay`. Feeding is off the tick's critical path: :meth:`PolicyPlacement.feed`
runs as requests arrive (ingest path, bounded per call, never waiting for a running tick); the tick's
:meth:`PolicyPlacement.observe` only feeds what is still queued (normally nothing) and takes the changes
accumulated since the last tick. The policy manages one tier (default ``cpu``, the DRAM tier below the
GPU, capacity from the policy document's tiers). Its resident set is the *desired placement* of that tier:
the planner diffs it against the index (admit/promote what the policy holds, evict/demote what it dropped).
P(reuse) comes from ``policy.reuse_probability`` when it has one (``learned``); NaN = cannot score, the
loop's index-trained / heuristic predictor fills in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.collectors.kv_requests import RequestInferrer
from kvtier.policies.base import Policy
from kvtier.policies.registry import get_policy
from kvtier.policies.slotmap import SlotMap, grown_size
from kvtier.policies.tiers import Tier

log = logging.getLogger(__name__)


class PolicyPlacement:
    """Owns one policy object, its request queue and the desired resident set of ``tier``."""

    def __init__(self, name: str, capacity_blocks: int, *, tier: Tier = Tier.CPU, seed: int = 0,
                 inferrer: RequestInferrer | None = None, policy: Policy | None = None,
                 options: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.name = name
        self.tier = tier
        self.seed = seed
        self.policy = (
            policy if policy is not None else get_policy(name, capacity_blocks, seed=seed, **(options or {}))
        )
        if self.policy.offline:
            raise ValueError(f"policy {name!r} needs the future (replay only); pick an online policy")
        self.requests = inferrer if inferrer is not None else RequestInferrer()
        # the desired set, kept incrementally as requests are fed: int64 block held by the policy -> index
        # row (-1: the index does not track it yet), the same as a row mask, and the blocks without a row
        self.desired = SlotMap()
        self._want = np.zeros(0, np.bool_)
        self._unknown: set[int] = set()
        self._epoch: object = None  # index epoch (slot reuse) the cached rows were resolved under
        self._row_slot = np.zeros(0, np.int32)  # index row -> policy slot (-1: not cached)
        self._warm_version: object = None  # policy refit count its memoised scores were warmed for
        # the last observe window: blocks requested -> index row (-1 unknown)
        self.touched: dict[int, int] = {}
        self._touched: dict[int, int] = {}  # accumulating for the next window
        # bounds that keep a flood of requests from stalling the tick or growing memory:
        self.max_observe_feed = 1024  # requests the tick's observe serves (~0.4 ms each, learned)
        self.max_touched = 1 << 18  # distinct requested blocks remembered per window (~40 MB at most)
        self.touched_dropped = 0  # requested blocks not remembered because a window was full
        self.max_carry = 65_536  # requested blocks not in the index yet, carried between windows
        self.lookup: Callable[[int], int] | None = None  # block -> index row (-1 unknown), set by the loop
        # guards the policy object: the tick (worker thread) and the ingest path (event loop) both use it
        self.lock = threading.Lock()
        self.served = 0  # requests served
        self.block_accesses = 0
        self.block_hits = 0  # blocks resident in the policy's tier when requested
        self.errors = 0
        # per-block memory bound of the policy object (blocks it has ever seen; None = unbounded, replay):
        # past it the policy restarts empty (policies cannot forget single blocks; counted in ``restarts``)
        self.max_slots: int | None = None
        self.restarts = 0

    @property
    def capacity_blocks(self) -> int:
        return self.policy.capacity_blocks

    def resize(self, capacity_blocks: int) -> None:
        """A new tier capacity (policy document change): a fresh policy object (policies cannot resize)."""
        if capacity_blocks == self.policy.capacity_blocks:
            return
        log.warning("placement tier %s resized %d -> %d blocks: policy %s restarts empty",
                    self.tier.value, self.policy.capacity_blocks, capacity_blocks, self.name)  # fmt: skip
        with self.lock:
            self.policy = get_policy(self.name, capacity_blocks, seed=self.seed)
            self.desired.clear()
            self._want[:] = False
            self._unknown.clear()
            self._row_slot[:] = -1

    def feed(self, max_requests: int | None = 64, *, blocking: bool = False) -> int:
        """Serve up to ``max_requests`` queued requests (None = all) through the policy, in arrival order;
        update the desired set. Non-blocking by default: returns 0 at once while a tick holds the policy
        (the requests stay queued). Returns the number of requests served."""
        if not self.lock.acquire(blocking=blocking):
            return 0
        try:
            n = self._feed(max_requests)
            seen = getattr(self.policy, "blocks_seen", None)  # policies with per-block state declare it
            if self.max_slots is not None and seen is not None and seen > self.max_slots:
                self._restart(f"it has seen {seen} blocks, more than its bound {self.max_slots}")
            return n
        finally:
            self.lock.release()

    def _restart(self, why: str) -> None:
        """A fresh policy object of the same capacity (caller holds :attr:`lock`)."""
        log.warning("placement policy %s restarts empty: %s", self.name, why)
        self.restarts += 1
        self.policy = get_policy(self.name, self.policy.capacity_blocks, seed=self.seed)
        self.desired.clear()
        self._want[:] = False
        self._unknown.clear()
        self._row_slot[:] = -1

    def _feed(self, max_requests: int | None) -> int:
        pol, desired, touched, lookup = self.policy, self.desired, self._touched, self.lookup
        contains_many = getattr(pol, "contains_many", None)
        done = 0
        while max_requests is None or done < max_requests:
            got = self.requests.drain(1)
            if not got:
                break
            req = got[0]
            hit = pol.access(req)
            self.block_accesses += int(hit.shape[0])
            self.block_hits += int(np.count_nonzero(hit))
            for v in pol.drain_evicted():
                self._drop(v)
            ids = req.hash_ids.tolist()
            room = self.max_touched - len(touched)
            for b in ids:
                if b not in touched:
                    if room <= 0:
                        self.touched_dropped += 1
                        continue
                    touched[b] = lookup(b) if lookup is not None else -1
                    room -= 1
            held = contains_many(req.hash_ids).tolist() if contains_many else [pol.contains(b) for b in ids]
            if any(held):
                cur = desired.get_list(ids, -2)  # -2: not in the desired set yet
                for b, h, c in zip(ids, held, cur, strict=True):
                    if h and c == -2:
                        row = touched.get(b)  # the row looked up above (None: the window was full)
                        if row is None:
                            row = lookup(b) if lookup is not None else -1
                        self._add(b, row)  # (a block repeated in the request: added again, idempotent)
            self.served += 1
            done += 1
        if done:
            self._warm_scores()
        return done

    def _warm_scores(self) -> None:
        """After the policy refitted its model (inside ``access``), recompute its memoised scores here, on
        the feeding path, so the next tick does not pay for it (``learned``: ``warm_scores``)."""
        warm = getattr(self.policy, "warm_scores", None)
        version = getattr(self.policy, "retrains", None)
        if warm is None or version == self._warm_version:
            return
        self._warm_version = version
        warm()

    def _add(self, block: int, row: int) -> None:
        self.desired.put(block, row)
        if row < 0:
            self._unknown.add(block)
            return
        if row >= self._want.shape[0]:
            self._want = _grown(self._want, row + 1, False)
        self._want[row] = True

    def _drop(self, block: int) -> None:
        row = self.desired.pop(block, -2)
        if row >= 0:
            if row < self._want.shape[0]:
                self._want[row] = False
        elif row == -1:
            self._unknown.discard(block)

    def desired_blocks(self) -> npt.NDArray[np.int64]:
        """The blocks the policy holds (fed through :meth:`feed`), table order."""
        return self.desired.items()[0]

    def observe(self) -> None:
        """Tick side (call with :attr:`lock` held): serve the requests queued when it is called (at most
        :attr:`max_observe_feed`), then start a new accumulation window. :attr:`touched` then holds the
        blocks requested since the previous observe, :attr:`desired` the policy's resident set now.

        Bounded, not "until empty": requests keep arriving on the ingest path while the tick feeds them,
        and when they arrive faster than the policy serves them, feeding until empty never returns -- the
        tick stalls and the window's accumulators grow with every block seen. The rest stays queued for
        the ingest path and the loop's between-tick feeding (:meth:`feed`)."""
        self._feed(min(len(self.requests), self.max_observe_feed))
        self.touched, self._touched = self._touched, {}

    def touched_rows(
        self, hashes: npt.NDArray[np.int64], lookup: Callable[[int], int]
    ) -> npt.NDArray[np.int64]:
        """Index rows of the blocks requested in the last window. Blocks the index does not track yet are
        carried into the next window (at most ``max_carry``), so each one is resolved once it is stored."""
        if not self.touched:
            return np.zeros(0, np.int64)
        rows = _rows(self.touched, hashes, lookup)
        ok = (rows >= 0) & (rows < hashes.shape[0])
        if not ok.all():
            keys = np.fromiter(self.touched.keys(), np.int64, len(self.touched))[~ok]
            for k in keys[: max(0, self.max_carry - len(self._touched))].tolist():
                self._touched.setdefault(k, -1)
        return rows[ok]

    def desired_mask(
        self, hashes: npt.NDArray[np.int64], lookup: Callable[[int], int], epoch: object = None
    ) -> npt.NDArray[np.bool_]:
        """Per index row (``hashes``: row -> block, ``lookup``: block -> row or -1): does the policy hold
        this block (the desired placement of :attr:`tier`)? A copy of the mask kept up to date as requests
        are fed. ``epoch``: the index's slot-reuse epoch (:attr:`BlockIndex.epoch`); while it is unchanged
        a cached row stays valid and only blocks without a row yet are looked up; when it changes, or is
        None (unknown), every cached row is checked against ``hashes`` (vectorised) and re-looked up if
        stale. Blocks the index does not track cannot be placed: skipped."""
        n = hashes.shape[0]
        if epoch is None or epoch != self._epoch:
            self._revalidate(hashes, lookup)
            self._epoch = epoch
        elif self._unknown:
            for b in list(self._unknown):
                r = lookup(b)
                if r >= 0:
                    self._unknown.discard(b)
                    self._add(b, r)
        if self._want.shape[0] < n:
            self._want = _grown(self._want, n, False)
        return self._want[:n].copy()

    def _revalidate(self, hashes: npt.NDArray[np.int64], lookup: Callable[[int], int]) -> None:
        """Check every cached row against ``hashes``; re-look up stale / unknown ones; rebuild the mask."""
        n = hashes.shape[0]
        keys, rows = self.desired.items()
        ok = (rows >= 0) & (rows < n)
        ok[ok] = hashes[rows[ok]] == keys[ok]
        bad = np.flatnonzero(~ok)
        if bad.size:
            new = np.fromiter((lookup(k) for k in keys[bad].tolist()), np.int64, bad.size)
            self.desired.put_many(keys[bad], new)
            rows = rows.copy()
            rows[bad] = new
        self._unknown = set(keys[rows < 0].tolist())
        size = max(n, self._want.shape[0], int(rows.max()) + 1 if rows.size else 0)
        self._want = np.zeros(size, np.bool_)
        self._want[rows[rows >= 0]] = True
        self._row_slot[:] = -1  # rows may now hold other blocks

    def reuse_probability(
        self, blocks: npt.NDArray[np.int64], now_ms: float, rows: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.floating[Any]] | None:
        """The policy's P(reuse) per block (NaN = cannot score; float32 or float64, as the policy gives it),
        or None if the policy has no predictor.
        ``rows``: the blocks' index rows; with a policy that has stable slots (``slots_of`` +
        ``reuse_probability_slots``, e.g. ``learned``) the row -> slot mapping is cached (valid while the
        index epoch given to :meth:`desired_mask` holds), so no per-block hash lookup is repeated."""
        pol = self.policy
        by_slot = getattr(pol, "reuse_probability_slots", None)
        slots_of = getattr(pol, "slots_of", None)
        if rows is not None and by_slot is not None and slots_of is not None:
            top = int(rows.max()) + 1 if rows.size else 0
            if self._row_slot.shape[0] < top:
                self._row_slot = _grown(self._row_slot, top, -1)
            s = self._row_slot[rows].astype(np.int64)
            miss = np.flatnonzero(s < 0)
            if miss.size:
                s[miss] = slots_of(blocks[miss])
                self._row_slot[rows[miss]] = s[miss]  # -1 again where the policy never saw the block
            return np.asarray(by_slot(s, now_ms))
        fn = getattr(pol, "reuse_probability", None)
        if fn is None:
            return None
        return np.asarray(fn(blocks, now_ms), np.float64)

    def quality(self) -> dict[str, Any] | None:
        fn = getattr(self.policy, "quality", None)
        return dict(fn()) if fn is not None else None

    def retrain(self) -> bool:
        """Refit the policy's own model now (``learned``); False when it has none or too few labels."""
        fn = getattr(self.policy, "retrain", None)
        if fn is None:
            return False
        with self.lock:
            return bool(fn())

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tier": self.tier.value,
            "capacity_blocks": self.policy.capacity_blocks,
            "resident_blocks": len(self.policy),
            "requests_served": self.served,
            "block_accesses": self.block_accesses,
            "block_hits": self.block_hits,
            "requests_pending": len(self.requests),
            "blocks_pending": self.requests.pending_blocks,
            "touched_dropped": self.touched_dropped,  # a window's requested-block memory was full
            "inferred": dict(self.requests.counts),
            "errors": self.errors,
            "restarts": self.restarts,  # restarted empty at the per-block bound (max_slots)
            "max_slots": self.max_slots,
        }


def _grown(a: npt.NDArray[Any], n: int, fill: Any) -> npt.NDArray[Any]:
    """``a`` extended to at least ``n`` entries (doubling, +25 % once large), new ones ``fill``."""
    out = np.full(grown_size(a.shape[0], n), fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def _rows(
    d: dict[int, int], hashes: npt.NDArray[np.int64], lookup: Callable[[int], int]
) -> npt.NDArray[np.int64]:
    """Rows of ``d``'s blocks (``d``: block -> cached row); stale or unknown rows are looked up again and
    cached. -1 = the index does not track the block."""
    n = hashes.shape[0]
    keys = np.fromiter(d.keys(), np.int64, len(d))
    rows = np.fromiter(d.values(), np.int64, len(d))
    ok = (rows >= 0) & (rows < n)
    ok[ok] = hashes[rows[ok]] == keys[ok]
    for j in np.flatnonzero(~ok).tolist():
        k = int(keys[j])
        r = lookup(k)
        d[k] = r
        rows[j] = r
    return rows
