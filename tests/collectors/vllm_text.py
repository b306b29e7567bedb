"""vLLM ``/metrics`` exposition text for collector tests, written the way vLLM 0.32/0.33 serves it.

Family names, labels (``engine`` = DP engine index, ``model_name``), the ``_total`` / ``_created`` layout of
prometheus_client and the histogram bucket bounds are copied from a real vLLM 0.32 CPU scrape
(tests/e2e/data/vllm_cpu_0.32_metrics.txt) and ``/work/shared/reference/integrations.md`` §1.1. Histograms
are built from raw observations, so a test can state what was observed and derive the expected quantiles
independently of the code under test. Also: the PromQL reference quantile used as the oracle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

# vLLM 0.32's bucket bounds (as served by the real CPU build)
TTFT_LE = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
          40.0, 80.0)  # fmt: skip
E2E_LE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
          480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
HIST = {
    "ttft": ("vllm:time_to_first_token_seconds", TTFT_LE, "Histogram of time to first token in seconds."),
    "itl": ("vllm:inter_token_latency_seconds", ITL_LE, "Histogram of inter-token latency in seconds."),
    "e2e": ("vllm:e2e_request_latency_seconds", E2E_LE, "Histogram of e2e request latency in seconds."),
}
COUNTER = {  # EngineState attribute -> (family as registered, help)
    "pc_q": ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "pc_h": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "epc_q": ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector."),
    "epc_h": ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector."),
    "preempt": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "cached": ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
    "gen": ("vllm:generation_tokens", "Number of generation tokens processed."),
}
GAUGE = {
    "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}


@dataclass(frozen=True)
class EngineState:
    """Cumulative state of one (model, engine) as vLLM would export it."""

    model: str = "tiny"
    engine: str = "0"
    prompt: float = 0.0
    gen: float = 0.0
    pc_q: float = 0.0
    pc_h: float = 0.0
    epc_q: float = 0.0
    epc_h: float = 0.0
    cached: float = 0.0
    preempt: float = 0.0
    by_source: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    running: float = 0.0
    waiting: float = 0.0
    kv: float = 0.0
    ttft: tuple[float, ...] = ()  # every observation since the engine started
    itl: tuple[float, ...] = ()
    e2e: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # vLLM creates every source's child at start-up (all five are exported at 0)
        object.__setattr__(self, "by_source", {s: self.by_source.get(s, 0.0) for s in SOURCES})

    def then(self, **kw: object) -> EngineState:
        """The state a little later: numbers given are the new values, ``ttft``/``itl``/``e2e`` are appended,
        ``by_source`` entries are added (as counters grow)."""
        upd: dict[str, object] = {}
        for k, v in kw.items():
            if k in HIST:
                upd[k] = getattr(self, k) + tuple(cast(Iterable[float], v))
            elif k == "by_source":
                upd[k] = {s: self.by_source.get(s, 0.0) + v.get(s, 0.0) for s in SOURCES}  # type: ignore[attr-defined]
            else:
                upd[k] = v
        return replace(self, **upd)  # type: ignore[arg-type]


def _lbl(e: EngineState, **extra: str) -> str:
    labels = {"engine": e.engine, **extra, "model_name": e.model}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _num(x: float) -> str:
    return repr(float(x))


def bucket_counts(bounds: Sequence[float], obs: Iterable[float]) -> list[int]:
    """Cumulative counts per upper bound (``le`` includes the bound), +Inf last."""
    xs = list(obs)
    return [sum(1 for x in xs if x <= ub) for ub in (*bounds, math.inf)]


def render(
    engines: Sequence[EngineState],
    start_time: float | None = 1.79610737122e09,
    drop: Iterable[str] = (),
    extra: str = "",
) -> str:
    """Exposition text of an API server with these engines; ``drop`` omits families (registered names);
    ``extra`` is appended verbatim (e.g. an unknown family)."""
    dropped = set(drop)
    out = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 13109.0',
    ]
    if start_time is not None:
        out += [
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {_num(start_time)}",
        ]
    created = 1.7961076845e09
    for attr in ("running", "waiting"):
        fam, help_ = GAUGE[attr]
        if fam not in dropped:
            out += [f"# HELP {fam} {help_}", f"# TYPE {fam} gauge"]
            out += [f"{fam}{_lbl(e)} {_num(getattr(e, attr))}" for e in engines]
    fam = "vllm:num_requests_waiting_by_reason"
    out += [f"# HELP {fam} Number of waiting requests by reason.", f"# TYPE {fam} gauge"]
    out += [f"{fam}{_lbl(e, reason=r)} 0.0" for e in engines for r in ("capacity", "deferred")]
    fam, help_ = GAUGE["kv"]
    if fam not in dropped:
        out += [f"# HELP {fam} {help_}", f"# TYPE {fam} gauge"]
        out += [f"{fam}{_lbl(e)} {_num(e.kv)}" for e in engines]
    for attr, (fam, help_) in COUNTER.items():
        if fam in dropped:
            continue
        out += [f"# HELP {fam}_total {help_}", f"# TYPE {fam}_total counter"]
        out += [f"{fam}_total{_lbl(e)} {_num(getattr(e, attr))}" for e in engines]
        out += [f"# HELP {fam}_created {help_}", f"# TYPE {fam}_created gauge"]
        out += [f"{fam}_created{_lbl(e)} {_num(created)}" for e in engines]
        if attr == "cached" and "vllm:prompt_tokens_cached_by_source" not in dropped:
            f2 = "vllm:prompt_tokens_cached_by_source"
            h2 = "Prefix-cache hit tokens by the cache tier that supplied them."
            out += [f"# HELP {f2}_total {h2}", f"# TYPE {f2}_total counter"]
            out += [
                f"{f2}_total{_lbl(e, source=s)} {_num(v)}" for e in engines for s, v in e.by_source.items()
            ]
            out += [f"# HELP {f2}_created {h2}", f"# TYPE {f2}_created gauge"]
            out += [f"{f2}_created{_lbl(e, source=s)} {_num(created)}" for e in engines for s in e.by_source]
    for attr, (fam, bounds, help_) in HIST.items():
        if fam in dropped:
            continue
        out += [f"# HELP {fam} {help_}", f"# TYPE {fam} histogram"]
        for e in engines:
            obs: tuple[float, ...] = getattr(e, attr)
            for ub, c in zip((*bounds, math.inf), bucket_counts(bounds, obs), strict=True):
                le = "+Inf" if math.isinf(ub) else repr(ub)
                out.append(f'{fam}_bucket{{engine="{e.engine}",le="{le}",model_name="{e.model}"}} {_num(c)}')
            out.append(f"{fam}_count{_lbl(e)} {_num(len(obs))}")
            out.append(f"{fam}_sum{_lbl(e)} {_num(math.fsum(obs))}")
        out += [f"# HELP {fam}_created {help_}", f"# TYPE {fam}_created gauge"]
        out += [f"{fam}_created{_lbl(e)} {_num(created)}" for e in engines]
    return "\n".join(out) + "\n" + extra


def ref_quantile(q: float, bounds: Sequence[float], obs: Iterable[float]) -> float | None:
    """Oracle: PromQL's ``bucketQuantile`` (prometheus promql/quantile.go, 2.42) over the buckets the
    observations ``obs`` fill. Written from the Go source, independently of kvtier; None where PromQL gives
    NaN."""
    ups = [*bounds, math.inf]
    cum = bucket_counts(bounds, obs)
    total = cum[-1]
    if total == 0:
        return None
    rank = q * total
    # sort.Search(len(buckets)-1, count >= rank): the +Inf bucket is only reached if no finite one qualifies
    b = next((i for i in range(len(ups) - 1) if cum[i] >= rank), len(ups) - 1)
    if b == len(ups) - 1:
        return ups[-2]
    if b == 0 and ups[0] <= 0:
        return ups[0]
    start, count = 0.0, float(cum[b])
    if b > 0:
        start = ups[b - 1]
        count -= cum[b - 1]
        rank -= cum[b - 1]
    return start + (ups[b] - start) * (rank / count)
