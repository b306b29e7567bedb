"""Glue used by the CLI and benchmarks: resolve traces/configs, size capacities, run one or many replays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtier.policies.base import Request
from kvtier.policies.registry import get_policy
from kvtier.replay.engine import ReplayStats, RequestResult, replay
from kvtier.replay.tiers import StackConfig, TierStack, bundled_config, load_tier_config
from kvtier.replay.trace import bundled_trace_path, distinct_blocks, load_trace

BUNDLED_TRACE_NAMES = ("bundled", "conversation")


def resolve_trace(trace: str) -> Path:
    """``bundled``/``conversation`` -> the shipped trace; anything else is a path."""
    if trace in BUNDLED_TRACE_NAMES:
        return bundled_trace_path()
    return Path(trace)


def resolve_tiers(spec: str) -> StackConfig:
    """A tier config path, or the name of a bundled one (``llama3-8b``, ``llama3-70b``, ...)."""
    p = Path(spec)
    if not p.exists() and bundled_config(spec).exists():
        p = bundled_config(spec)
    if not p.exists():
        from kvtier.replay.tiers import bundled_config_names

        raise FileNotFoundError(
            f"tier config {spec!r} not found (neither a file nor a bundled config name; bundled: "
            f"{', '.join(bundled_config_names())})"
        )
    return load_tier_config(p)


def capacity_for(fraction: float | None, blocks: int | None, distinct: int) -> int | None:
    """``blocks`` if given, else ``round(fraction x distinct)``, else None."""
    if blocks is not None:
        if blocks < 0:
            raise ValueError(f"--capacity-blocks must be >= 0, got {blocks}")
        return blocks
    if fraction is not None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"--capacity is a fraction of distinct blocks in [0, 1], got {fraction}")
        return int(round(fraction * distinct))
    return None


@dataclass
class Workload:
    requests: list[Request]
    distinct_blocks: int
    path: Path


def load_workload(trace: str, *, max_requests: int | None = None, block_tokens: int = 512) -> Workload:
    path = resolve_trace(trace)
    reqs = load_trace(path, block_tokens=block_tokens, max_requests=max_requests)
    return Workload(reqs, distinct_blocks(reqs), path)


def run_one(
    wl: Workload,
    policy: str,
    capacity_blocks: int | None,
    *,
    seed: int = 0,
    tiers: StackConfig | None = None,
    per_request: IO[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Replay ``wl`` through ``policy`` (tier 0 of ``tiers`` if given)."""
    on_req: Callable[[RequestResult], None] | None = None
    if per_request is not None:
        import json

        fh = per_request

        def on_req(r: RequestResult) -> None:
            fh.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")

    if tiers is not None:
        stack = TierStack.build(
            tiers, policy, wl.distinct_blocks, top_capacity_blocks=capacity_blocks, seed=seed
        )
        pol = stack.top
        stats = replay(wl.requests, pol, tiers=stack, on_request=on_req, progress=progress)
    else:
        if capacity_blocks is None:
            raise ValueError("give --capacity or --capacity-blocks (or --tiers)")
        pol = get_policy(policy, capacity_blocks, seed)
        stats = replay(wl.requests, pol, on_request=on_req, progress=progress)
    quality = getattr(pol, "quality", None)
    if callable(quality):  # a learned policy's own out-of-sample quality (AUC, calibration, experts)
        stats.extra["predictor"] = quality()
    stats.extra["distinct_blocks"] = wl.distinct_blocks
    stats.extra["trace"] = str(wl.path)
    stats.extra["seed"] = seed
    return stats


def gap_closed(policy: float, lru: float, belady: float, *, min_gap: float = 0.01) -> float | None:
    """(policy - LRU) / (Belady - LRU); None where Belady - LRU < ``min_gap`` (ratio is noise there)."""
    g = belady - lru
    if g < min_gap:
        return None
    return (policy - lru) / g


def compare(
    wl: Workload,
    policies: Sequence[str],
    fractions: Sequence[float],
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run every policy at every capacity fraction; add gap closed vs LRU/Belady when both are present."""
    results: dict[str, dict[float, ReplayStats]] = {p: {} for p in policies}
    done = 0
    for p in policies:
        for f in fractions:
            cap = capacity_for(f, None, wl.distinct_blocks)
            base = done

            def prog(n: int, base: int = base) -> None:
                if progress is not None:
                    progress(base + n)

            results[p][f] = run_one(wl, p, cap, seed=seed, progress=prog)
            done += len(wl.requests)
    rows = []
    for p in policies:
        for f in fractions:
            s = results[p][f]
            row: dict[str, Any] = {
                "policy": p,
                "capacity": f,
                "capacity_blocks": s.capacity_blocks,
                "prefix_hit_ratio": s.prefix_hit_ratio,
                "block_hit_ratio": s.block_hit_ratio,
                "wall_s": round(s.wall_s, 4),
            }
            if "lru" in results and "belady" in results:
                row["gap_closed"] = gap_closed(
                    s.prefix_hit_ratio,
                    results["lru"][f].prefix_hit_ratio,
                    results["belady"][f].prefix_hit_ratio,
                )
            rows.append(row)
    return {
        "trace": str(wl.path),
        "requests": len(wl.requests),
        "distinct_blocks": wl.distinct_blocks,
        "policies": list(policies),
        "capacities": list(fractions),
        "results": rows,
    }
