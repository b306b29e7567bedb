"""An emulated tiered KV cache (HBM -> DRAM -> NVMe -> remote) standing in for an engine + cache layer.

Wraps a :class:`~kvtier.replay.tiers.TierStack` (tier placement, bytes moved per link, TTFT cost model) and,
when given, mirrors its residency into the sidecar's :class:`BlockIndex` (what a real engine's KV events and
the cache layer's collectors would report) and exports ``kvtier_tier_*`` metrics through
:class:`~kvtier.controller.tier_metrics.TierMetrics`. Not thread-safe: callers serialise with the loop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kvtier.controller.control_sidecar import ControlIngestor
from kvtier.controller.tier_metrics import TierMetrics
from kvtier.policies.base import Request
from kvtier.policies.index import BlockIndex
from kvtier.replay.tiers import TierConfig, TierStack


class EmulatedIngestor(ControlIngestor):
    """No KV events in the emulation: blocks tracked per tier come straight from the index it fills."""

    def blocks_tracked(self) -> dict[str, int]:
        return {t.value: int(n) for t, n in self.index.count_by_tier().items()}


def with_lower_policy(config: TierConfig, policy: str = "lru") -> TierConfig:
    """``config`` with every tier below the first run by ``policy`` (the cache layer's own eviction)."""
    tiers = (config.tiers[0],) + tuple(replace(t, policy=policy) for t in config.tiers[1:])
    return replace(config, tiers=tiers)


class EmulatedCache:
    """One emulated tier stack fed request by request; keeps the figures the demo compares."""

    def __init__(
        self,
        stack: TierStack,
        *,
        index: BlockIndex | None = None,
        metrics: TierMetrics | None = None,
    ) -> None:
        self.stack = stack
        self.index = index
        self.metrics = metrics
        self.names = list(stack.tier_names)
        self.block_bytes = stack.block_bytes
        self.requests = 0
        self.input_tokens = 0
        self.ttft_ms: list[float] = []
        self._evicted: list[list[int]] = [[] for _ in self.names]
        self._links_seen: dict[str, int] = {}
        self._pref_seen = np.zeros(len(self.names), dtype=np.int64)
        self._lookup_seen = 0
        if index is not None:
            for k, st in enumerate(stack._t):  # capture evictions per tier to mirror demotions into the index
                st.policy.drain_evicted = self._recorder(k, st.policy.drain_evicted)  # type: ignore[method-assign]
        if metrics is not None:
            for k, st in enumerate(stack._t):
                metrics.capacity.labels(tier=self.names[k]).set(st.policy.capacity_blocks * self.block_bytes)

    def _recorder(self, k: int, drain: Any) -> Any:
        sink = self._evicted[k]

        def drain_evicted() -> list[int]:
            out: list[int] = drain()
            sink.extend(out)
            return out

        return drain_evicted

    def serve(self, req: Request) -> float:
        """Serve one request; returns its estimated TTFT (ms)."""
        _, tier_of, ttft = self.stack.access(req)
        if len(self.names) > 1:
            top = self.stack.top
            skipped = [h for h, k in zip(req.hash_ids.tolist(), tier_of.tolist(), strict=True)
                       if k < 0 and not top.contains(h)]  # fmt: skip
            if skipped:
                self._write_through(skipped, req)
        self.requests += 1
        self.input_tokens += req.input_length
        self.ttft_ms.append(ttft)
        if self.index is not None:
            self._mirror(req, tier_of)
        return ttft

    def _write_through(self, ids: list[int], req: Request) -> None:
        """Blocks tier 0 declined to admit are still written to tier 1 (a cache layer such as LMCache
        stores every computed chunk), with the same demotion cascade as evictions (``TierStack.access``)."""
        st = self.stack._t
        ev = ids
        for k in range(1, len(st)):
            if not ev:
                return
            self.stack._down[k] += len(ev)
            for b in ev:
                self.stack._where[b] = k
            st[k].policy.access(
                Request(req.timestamp_ms, 0, 0, np.asarray(ev, dtype=np.int64), req.block_tokens)
            )
            ev = st[k].policy.drain_evicted()
            st[k].evictions += len(ev)
        self.stack.dropped += len(ev)
        for b in ev:
            self.stack._where.pop(b, None)

    def _mirror(self, req: Request, tier_of: np.ndarray) -> None:
        idx, names, bb, t = self.index, self.names, self.block_bytes, req.timestamp_ms
        assert idx is not None
        last = len(names) - 1
        # evictions first: a block evicted from tier k now sits in tier k+1 (or is gone from the last)
        for k, evs in enumerate(self._evicted):
            for b in evs:
                idx.remove(b, names[k])
                if k < last:
                    idx.store(b, None, names[k + 1], bb, t)
            evs.clear()
        ids = req.hash_ids.tolist()
        idx.access_chain(ids, t)
        top = self.stack.top
        parent: int | None = None
        for h, k in zip(ids, tier_of.tolist(), strict=True):
            if k != 0 and top.contains(h):  # admitted (miss) or promoted from tier k
                if k > 0:
                    idx.remove(h, names[k])
                idx.store(h, parent, names[0], bb, t)
            elif k < 0 and last:  # declined by tier 0, written through to tier 1
                idx.store(h, parent, names[1], bb, t)
            parent = h

    def publish(self) -> None:
        """Push usage, hit tokens, lookups and bytes moved since the last call into the metrics."""
        m = self.metrics
        if m is None:
            return
        for k, st in enumerate(self.stack._t):
            m.used.labels(tier=self.names[k]).set(len(st.policy) * self.block_bytes)
        pref = self.stack._pref_tokens
        for k in np.flatnonzero(pref != self._pref_seen).tolist():
            m.hit_tokens.labels(tier=self.names[k]).inc(int(pref[k] - self._pref_seen[k]))
        self._pref_seen = pref.copy()
        if self.input_tokens > self._lookup_seen:
            m.lookup_tokens.inc(self.input_tokens - self._lookup_seen)
            self._lookup_seen = self.input_tokens
        links = self.stack.links
        m.add_moved({k: v - self._links_seen.get(k, 0) for k, v in links.items()})
        self._links_seen = dict(links)

    def report(self) -> dict[str, Any]:
        """Prefix hit per tier, bytes moved per link, TTFT p50/p99 and prefill-bound throughput."""
        summ = self.stack.summary()
        tok = max(1, self.input_tokens)
        a = np.asarray(self.ttft_ms) if self.ttft_ms else np.zeros(1)
        busy_s = float(a.sum()) / 1e3
        links = dict(sorted(self.stack.links.items()))
        return {
            "policy": self.stack.top.name,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "prefix_hit_by_tier": {s["tier"]: s["prefix_hit_tokens"] / tok for s in summ},
            "prefix_hit": sum(s["prefix_hit_tokens"] for s in summ) / tok,
            "bytes_moved": links,
            "bytes_moved_total": sum(links.values()),
            "ttft_p50_ms": float(np.percentile(a, 50)),
            "ttft_p99_ms": float(np.percentile(a, 99)),
            "ttft_mean_ms": float(a.mean()),
            # one instance, prefill-bound: requests/s and prompt tokens/s it sustains at these TTFTs
            "throughput_req_s": self.requests / busy_s if busy_s > 0 else 0.0,
            "throughput_tokens_s": self.input_tokens / busy_s if busy_s > 0 else 0.0,
        }
