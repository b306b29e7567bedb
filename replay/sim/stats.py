"""Per-arm figures with 95% confidence intervals by batch means.

Requests are split, in arrival order, into ``batches`` consecutive batches (the same batches in every arm,
so arms compare batch by batch). Each statistic (TTFT p50, TTFT p99, throughput) is computed per batch;
its 95% CI is ``mean +- t(0.975, k-1) * sd / sqrt(k)`` over the batches (batch means: consecutive batches
of a long run are close to independent). Differences between two arms use the paired per-batch differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from kvtier.replay.sim.serving import RequestRecord


def t975(df: int) -> float:
    """The 97.5 % Student t quantile (a two-sided 95 % interval) for ``df`` degrees of freedom."""
    return math.inf if df <= 0 else float(stats.t.ppf(0.975, df))


def ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, 95% half-width) of per-batch values."""
    a = np.asarray(values, dtype=np.float64)
    if a.size < 2:
        return (float(a.mean()) if a.size else 0.0, math.inf)
    return float(a.mean()), float(t975(a.size - 1) * a.std(ddof=1) / math.sqrt(a.size))


def batch_stats(recs: Sequence[RequestRecord]) -> dict[str, float]:
    """TTFT p50/p99 (s) and output-token throughput (tokens/s) of one batch of requests."""
    done = [r for r in recs if r.first_token_s >= 0]
    if not done:
        return {"ttft_p50_s": math.nan, "ttft_p99_s": math.nan, "throughput_tokens_per_s": 0.0}
    t = np.array([r.ttft_s for r in done])
    span = max(r.done_s for r in done) - min(r.arrival_s for r in done)
    out = sum(r.output_tokens for r in done)
    return {
        "ttft_p50_s": float(np.percentile(t, 50)),
        "ttft_p99_s": float(np.percentile(t, 99)),
        "throughput_tokens_per_s": out / span if span > 0 else 0.0,
    }


def split(recs: Sequence[RequestRecord], batches: int) -> list[Sequence[RequestRecord]]:
    n = len(recs)
    k = max(1, min(batches, n))
    edges = [round(i * n / k) for i in range(k + 1)]
    return [recs[edges[i] : edges[i + 1]] for i in range(k)]


KEYS = ("ttft_p50_s", "ttft_p99_s", "throughput_tokens_per_s")


def summarize(recs: Sequence[RequestRecord], batches: int = 10) -> dict[str, Any]:
    """Whole-run figures plus, per key, ``<key>_ci95`` (half-width over batch means)."""
    out: dict[str, Any] = dict(batch_stats(recs))
    per = [batch_stats(b) for b in split(recs, batches)]
    for k in KEYS:
        _, hw = ci([p[k] for p in per])
        out[f"{k}_ci95"] = hw
    out["batches"] = len(per)
    out["per_batch"] = per
    return out


def paired_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per key: mean of (b - a) over the shared batches and its 95% half-width."""
    out = {}
    for k in KEYS:
        d = [y[k] - x[k] for x, y in zip(a["per_batch"], b["per_batch"], strict=True)]
        m, hw = ci(d)
        out[k] = {"mean": m, "ci95": hw}
    return out
