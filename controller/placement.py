"""The configured placement :class:`~kvtier.policies.base.Policy` inside the live loop (``--policy NAME``).

The same objects replay drives: the loop's observe phase feeds every request inferred since the last tick
(:class:`~kvtier.collectors.kv_requests.RequestInferrer`: KV events, or trace requests in shadow replay)
to ``policy.access`` in arrival order and drains ``drain_evicted()`` after each one, exactly like
:func:`kvtier.replay.engine.replay`. The policy manages one tier (default ``cpu``, the DRAM tier below the
GPU, capacity from the policy document's tiers). Its resident set is the *desired placement* of that tier:
the planner diffs it against the index (admit/promote what the policy holds, evict/demote what it dropped).
P(reuse) comes from ``policy.reuse_probability`` when it has one (``learned``); NaN = cannot score, the
loop's index-trained / heuristic predictor fills in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.collectors.kv_requests import RequestInferrer
from kvtier.policies.base import Policy, Request
from kvtier.policies.registry import get_policy
from kvtier.policies.tiers import Tier

log = logging.getLogger(__name__)


class PolicyPlacement:
    """Owns one policy object, its request queue and the desired resident set of ``tier``."""

    def __init__(self, name: str, capacity_blocks: int, *, tier: Tier = Tier.CPU, seed: int = 0,
                 inferrer: RequestInferrer | None = None, policy: Policy | None = None) -> None:  # fmt: skip
        self.name = name
        self.tier = tier
        self.seed = seed
        self.policy = policy if policy is not None else get_policy(name, capacity_blocks, seed=seed)
        if self.policy.offline:
            raise ValueError(f"policy {name!r} needs the future (replay only); pick an online policy")
        self.requests = inferrer if inferrer is not None else RequestInferrer()
        self.desired: dict[int, int] = {}  # int64 block held by the policy -> index row (cached; -1 unknown)
        self.victims: list[int] = []  # drained evictions of the last observe, oldest first
        self.served = 0  # requests served
        self.block_accesses = 0
        self.block_hits = 0  # blocks resident in the policy's tier when requested
        self.errors = 0

    @property
    def capacity_blocks(self) -> int:
        return self.policy.capacity_blocks

    def resize(self, capacity_blocks: int) -> None:
        """A new tier capacity (policy document change): a fresh policy object (policies cannot resize)."""
        if capacity_blocks == self.policy.capacity_blocks:
            return
        log.warning("placement tier %s resized %d -> %d blocks: policy %s restarts empty",
                    self.tier.value, self.policy.capacity_blocks, capacity_blocks, self.name)  # fmt: skip
        self.policy = get_policy(self.name, capacity_blocks, seed=self.seed)
        self.desired.clear()

    def observe(self) -> list[Request]:
        """Serve every queued request through the policy (arrival order); update the desired set."""
        reqs = self.requests.drain()
        self.victims = []
        pol, desired = self.policy, self.desired
        for req in reqs:
            hit = pol.access(req)
            self.block_accesses += int(hit.shape[0])
            self.block_hits += int(np.count_nonzero(hit))
            ev = pol.drain_evicted()
            for v in ev:
                desired.pop(v, None)
            self.victims.extend(ev)
            for b in req.hash_ids.tolist():
                if b not in desired and pol.contains(b):
                    desired[b] = -1
            self.served += 1
        return reqs

    def desired_mask(
        self, hashes: npt.NDArray[np.int64], lookup: Callable[[int], int]
    ) -> npt.NDArray[np.bool_]:
        """Per index row (``hashes``: row -> block, ``lookup``: block -> row or -1): does the policy hold
        this block (the desired placement of :attr:`tier`)? Rows are cached per block and re-looked up
        only when stale. Blocks the index does not track cannot be placed: skipped."""
        n = hashes.shape[0]
        mask = np.zeros(n, np.bool_)
        d = self.desired
        if not d:
            return mask
        keys = np.fromiter(d.keys(), np.int64, len(d))
        rows = np.fromiter(d.values(), np.int64, len(d))
        ok = (rows >= 0) & (rows < n)
        ok[ok] = hashes[rows[ok]] == keys[ok]
        for j in np.flatnonzero(~ok).tolist():
            k = int(keys[j])
            r = lookup(k)
            d[k] = r
            rows[j] = r
        rows = rows[(rows >= 0) & (rows < n)]
        mask[rows] = True
        return mask

    def reuse_probability(
        self, blocks: npt.NDArray[np.int64], now_ms: float
    ) -> npt.NDArray[np.float64] | None:
        """The policy's P(reuse) per block (NaN = cannot score), or None if the policy has no predictor."""
        fn = getattr(self.policy, "reuse_probability", None)
        if fn is None:
            return None
        return np.asarray(fn(blocks, now_ms), np.float64)

    def quality(self) -> dict[str, Any] | None:
        fn = getattr(self.policy, "quality", None)
        return dict(fn()) if fn is not None else None

    def retrain(self) -> bool:
        """Refit the policy's own model now (``learned``); False when it has none or too few labels."""
        fn = getattr(self.policy, "retrain", None)
        return bool(fn()) if fn is not None else False

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
            "inferred": dict(self.requests.counts),
            "errors": self.errors,
        }
