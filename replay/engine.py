"""Replay engine: drives one :class:`~kvtier.policies.base.Policy` (optionally atop emulated lower tiers)
over a trace and accounts block hits, token-weighted prefix hits and, with tiers, TTFT and bytes moved.

Metrics (as in ``shared/reference/trace_baselines.md`` §3):

* ``block_hit_ratio`` = hit block accesses / block accesses.
* ``prefix_hit_ratio`` = token-weighted prefix hit: a request's reusable tokens stop at its first missing
  block (``block_tokens`` per block; if every block hits, its whole ``input_length`` counts), summed and
  divided by all input tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.policies.base import Policy, Request, prefix_tokens

if TYPE_CHECKING:
    from kvtier.replay.tiers import TierStack


@dataclass(slots=True)
class RequestResult:
    """Outcome of one request (one ``--per-request`` line)."""

    index: int  # 0-based position in the trace
    timestamp_ms: float
    blocks: int  # len(hash_ids)
    hit_blocks: int  # blocks resident anywhere when requested
    prefix_hit_blocks: int  # leading run of hits
    prefix_hit_tokens: int  # reusable tokens (see module doc)
    input_tokens: int
    hit_tiers: list[str]  # tier name of each hit block, in block order
    ttft_ms: float | None = None  # estimated time to first token (tiers given)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request": self.index,
            "timestamp_ms": self.timestamp_ms,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "input_tokens": self.input_tokens,
            "hit_tiers": self.hit_tiers,
        }
        if self.ttft_ms is not None:
            d["ttft_ms"] = round(self.ttft_ms, 6)
        return d


@dataclass
class ReplayStats:
    """Totals of one replay run."""

    policy: str
    capacity_blocks: int
    requests: int = 0
    block_accesses: int = 0
    block_hits: int = 0
    prefix_hit_blocks: int = 0
    prefix_hit_tokens: int = 0
    input_tokens: int = 0
    wall_s: float = 0.0
    tiers: list[dict[str, Any]] | None = None
    ttft: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": self.requests,
            "block_accesses": self.block_accesses,
            "block_hits": self.block_hits,
            "block_hit_ratio": self.block_hit_ratio,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "input_tokens": self.input_tokens,
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "wall_s": round(self.wall_s, 4),
            "block_accesses_per_s": round(self.block_accesses / self.wall_s) if self.wall_s > 0 else None,
        }
        if self.tiers is not None:
            d["tiers"] = self.tiers
        if self.ttft is not None:
            d["ttft"] = self.ttft
        if self.extra:
            d.update(self.extra)
        return d


def replay(
    requests: Iterable[Request],
    policy: Policy,
    *,
    tiers: TierStack | None = None,
    on_request: Callable[[RequestResult], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Replay ``requests`` in order through ``policy`` (tier 0 of ``tiers`` when given).

    ``on_request`` gets each :class:`RequestResult` in trace order; ``progress`` gets the number of
    requests done (called every 256 requests and at the end). Offline policies get ``prepare`` first.
    """
    reqs: Iterable[Request] = requests
    if policy.offline:
        seq = requests if isinstance(requests, Sequence) else list(requests)
        policy.prepare(seq)
        reqs = seq
    stats = ReplayStats(policy=policy.name, capacity_blocks=policy.capacity_blocks)
    tier0_name = tiers.tier_names[0] if tiers is not None else "gpu"
    t0 = time.perf_counter()
    n_req = 0
    acc = hits_total = lead_total = tok_hit = tok_in = 0
    for i, req in enumerate(reqs):
        n = len(req.hash_ids)
        if tiers is not None:
            hits, tier_of, ttft = tiers.access(req)
            names = tiers.tier_names
            hit_tiers = [names[t] for t in tier_of[hits].tolist()] if on_request is not None else []
        else:
            hits = policy.access(req)
            ttft = None
            hit_tiers = [tier0_name] * int(hits.sum()) if on_request is not None else []
            policy.drain_evicted()
        if hits.shape != (n,):
            raise RuntimeError(f"policy {policy.name} returned {hits.shape} hits for {n} blocks")
        nh = int(np.count_nonzero(hits))
        lead = n if nh == n else int(hits.argmin())
        pt = prefix_tokens(req, lead)
        acc += n
        hits_total += nh
        lead_total += lead
        tok_hit += pt
        tok_in += req.input_length
        n_req += 1
        if on_request is not None:
            on_request(
                RequestResult(
                    index=i,
                    timestamp_ms=req.timestamp_ms,
                    blocks=n,
                    hit_blocks=nh,
                    prefix_hit_blocks=lead,
                    prefix_hit_tokens=pt,
                    input_tokens=req.input_length,
                    hit_tiers=hit_tiers,
                    ttft_ms=ttft,
                )
            )
        if progress is not None and n_req % 256 == 0:
            progress(n_req)
    if progress is not None:
        progress(n_req)
    stats.requests = n_req
    stats.block_accesses = acc
    stats.block_hits = hits_total
    stats.prefix_hit_blocks = lead_total
    stats.prefix_hit_tokens = tok_hit
    stats.input_tokens = tok_in
    stats.wall_s = time.perf_counter() - t0
    if tiers is not None:
        stats.tiers = tiers.summary()
        stats.ttft = tiers.ttft_summary()
    return stats
