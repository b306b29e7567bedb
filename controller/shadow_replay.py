"""Shadow mode over a replayed trace: the live loop's decisions scored against what the trace did next.

The trace drives the simulator's cache layer (:class:`~kvtier.replay.sim.layer.CacheLayer`, HBM only: vLLM's
LRU prefix cache) whose residency reports feed the real :class:`BlockIndex`; the real :class:`ReconcileLoop`
ticks in ``shadow`` mode on the trace's
clock, so every decision is recorded and later scored counterfactually (did the block come back within the
horizon, i.e. would the move have produced a hit). Nothing is actuated.

Each trace request is also queued, as is, to the loop's placement policy object (``policy_name``, the same
path KV-event-inferred requests take live: :class:`~kvtier.controller.placement.PolicyPlacement`), which
places the CPU tier. The CPU tier is emulated too: its planned moves are applied to the index as a cache
layer would report them, so the level-based diff sees its own effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.controller.loop import TickReport
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.root import build_loop
from kvtier.policies.base import Request
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import HBM_BYTES_S, Tier, TierSpec
from kvtier.replay.sim.layer import CacheLayer
from kvtier.replay.sim.report import IndexReporter


def run_shadow_replay(
    requests: Sequence[Request],
    *,
    gpu_blocks: int,
    tick_s: float = 5.0,
    horizon_s: float = 120.0,
    cpu_blocks: int | None = None,
    policy: PolicyDoc | None = None,
    policy_name: str | None = "learned",
) -> dict[str, Any]:
    """Replay ``requests`` (timestamps in ms) and return the shadow report plus baseline hit figures."""
    doc = policy or PolicyDoc(
        mode="shadow",
        tiers=[
            TierSpec(
                tier=Tier.GPU,
                capacity_blocks=gpu_blocks,
                high_watermark=0.9,
                low_watermark=0.8,
                load_bandwidth_bytes_s=1e12,
            ),
            TierSpec(
                tier=Tier.CPU, capacity_blocks=cpu_blocks or 2 * gpu_blocks, load_bandwidth_bytes_s=2e10
            ),
        ],
        shadow_horizon_s=horizon_s,
        block_size_tokens=requests[0].block_tokens if requests else 512,
        hysteresis_s=horizon_s,
    )
    idx = BlockIndex()
    now = [requests[0].timestamp_ms / 1000.0 if requests else 0.0]
    loop = build_loop(
        idx,
        policy=doc,
        metrics=ControllerMetrics(CollectorRegistry()),
        clock=lambda: now[0],
        placement_policy=policy_name,
        placement_tier=Tier.CPU,
        assume_admittable=True,
    )
    # vLLM's prefix cache in the simulator (no offload); nbytes 0: the loop prices blocks by the document
    layer = CacheLayer([TierSpec(Tier.GPU, gpu_blocks, load_bandwidth_bytes_s=HBM_BYTES_S)], 0, offload=False,
                       observer=IndexReporter(idx, 0))  # fmt: skip
    hits = misses = 0
    next_tick = now[0]
    for req in requests:
        t = req.timestamp_ms / 1000.0
        while next_tick <= t:
            now[0] = next_tick
            _emulate_cpu_layer(idx, loop.tick())
            next_tick += tick_s
        now[0] = t
        if loop.placement is not None:
            loop.placement.requests.submit(req)
            loop.placement.feed(None)  # as it arrives (off the tick's path), like the ingest hook
        ids = req.hash_ids.tolist()
        layer.now = t
        look = layer.lookup(ids, req.input_length, req.block_tokens)
        layer.store(ids, look.hit_blocks)
        hits += look.hit_blocks
        misses += len(ids) - look.hit_blocks
    # stop deciding, and let every pending decision reach its horizon
    loop.set_policy(loop.policy.model_copy(update={"mode": "off"}))
    end = now[0] + horizon_s + tick_s
    while next_tick <= end:
        now[0] = next_tick
        loop.tick()
        next_tick += tick_s
    rep = loop.decisions.report
    tokens = doc.block_size_tokens
    return {
        "requests": len(requests),
        "ticks": loop.tick_no,
        "baseline_block_hits": hits,
        "baseline_block_misses": misses,
        "baseline_hit_ratio": hits / max(1, hits + misses),
        "decisions": loop.decisions.total,
        "shadow": rep.to_dict(),
        "counterfactual_hit_gain_blocks": rep.hits_gained,
        "counterfactual_hit_gain_tokens": rep.tokens_gained,
        "counterfactual_hit_gain_vs_baseline": rep.hits_gained / max(1, hits),
        "regrets": rep.regrets,
        "net_gain_blocks": rep.hits_gained - rep.regrets,
        "tokens_per_block": tokens,
        "placement": loop.placement.info() if loop.placement is not None else None,
        "loop": loop,
    }


def _emulate_cpu_layer(idx: BlockIndex, rep: TickReport) -> None:
    """Apply the tick's CPU-tier moves to the index, as the cache layer's events would report them."""
    for m in rep.plan.moves if rep.plan is not None else ():
        if m.action in ("admit", "promote") and m.dst is Tier.CPU:
            idx.store(m.block, None, Tier.CPU)
        elif m.action in ("evict", "demote") and m.src is Tier.CPU:
            idx.remove(m.block, Tier.CPU)
            if m.dst is not None:
                idx.store(m.block, None, m.dst)
