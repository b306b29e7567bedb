"""vLLM ``/metrics`` -> one typed :class:`EngineSample` per (model, engine / DP rank).

Names are those of ``vllm/v1/metrics/loggers.py`` (vLLM 0.32 CPU build and 0.33). Rates and latency quantiles
are computed from the deltas between two scrapes (histogram quantiles by linear interpolation inside the
bucket, as PromQL's ``histogram_quantile``). Any monotonic series of an engine that went down (a counter, a
cached-by-source counter, a histogram bucket / count / sum), or a new ``process_start_time_seconds``, is a
restart of that engine: every delta is then the new value itself (counted from 0). A series missing from one
scrape (e.g. its block was broken) keeps its last value and time, so the next rate / window spans from there
(no spike, no silent zero). Families the collector does not know are tolerated and counted
(``unknown_families``), as are expected ones that are absent (``missing_families``)."""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Gauge

from kvtier.collectors.base import Clock, HttpCollector, Observation
from kvtier.collectors.promtext import ParsedText, parse_families

# sample names this collector maps (counters carry prometheus_client's _total suffix)
C_PROMPT = "vllm:prompt_tokens_total"
C_GEN = "vllm:generation_tokens_total"
C_PC_Q = "vllm:prefix_cache_queries_total"
C_PC_H = "vllm:prefix_cache_hits_total"
C_EPC_Q = "vllm:external_prefix_cache_queries_total"
C_EPC_H = "vllm:external_prefix_cache_hits_total"
C_CACHED = "vllm:prompt_tokens_cached_total"
C_CACHED_SRC = "vllm:prompt_tokens_cached_by_source_total"
C_PREEMPT = "vllm:num_preemptions_total"
G_KV = "vllm:kv_cache_usage_perc"
G_RUN = "vllm:num_requests_running"
G_WAIT = "vllm:num_requests_waiting"
H_TTFT = "vllm:time_to_first_token_seconds"
H_ITL = "vllm:inter_token_latency_seconds"
H_E2E = "vllm:e2e_request_latency_seconds"
START = "process_start_time_seconds"

COUNTERS = (C_PROMPT, C_GEN, C_PC_Q, C_PC_H, C_EPC_Q, C_EPC_H, C_CACHED, C_PREEMPT)
HISTOGRAMS = (H_TTFT, H_ITL, H_E2E)
# the sample names read; the parser skips the rest (a live scrape is ~650 lines, most of them histograms
# this collector does not read)
READ_SAMPLES = frozenset(
    {*COUNTERS, C_CACHED_SRC, G_KV, G_RUN, G_WAIT, START}
    | {h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
EXPECTED_FAMILIES = frozenset(
    {
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
        "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:num_preemptions", H_TTFT, H_ITL, H_E2E,
    }
)  # fmt: skip
# every vllm: family of integrations.md §1.1 (+ what the 0.32 CPU build emits) -- anything else is "unknown"
KNOWN_FAMILIES = EXPECTED_FAMILIES | frozenset(
    {
        "vllm:num_requests_waiting_by_reason", "vllm:num_requests_kv_fetch_by_stage",
        "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens_cached",
        "vllm:prompt_tokens_cached_by_source", "vllm:prompt_tokens_by_source", "vllm:request_success",
        "vllm:admission_rejections", "vllm:request_time_per_output_token_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:request_num_preemptions",
        "vllm:request_prefill_kv_computed_tokens", "vllm:kv_block_lifetime_seconds",
        "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds",
        "vllm:engine_sleep_state",
        "vllm:cache_config_info", "vllm:mm_cache_queries", "vllm:mm_cache_hits",
        "vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
        "vllm:estimated_write_bytes_per_gpu", "vllm:lora_requests_info",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency over the scrape window from histogram bucket deltas, seconds. On an engine's first scrape and
    at a restart the window is "since the engine started"; no new observations -> count 0, the rest None."""

    count: float  # observations in the window
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One (model, engine) at one scrape. Cumulative values are vLLM's own counters (since its start)."""

    model: str
    engine: str  # vLLM's `engine` label: the DP engine index
    interval_s: float | None  # seconds since the previous scrape of this engine (None on the first)
    restarted: bool  # a counter reset / new process start was seen at this scrape
    prompt_tokens_total: float
    generation_tokens_total: float
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    prefix_cache_queries: float  # tokens queried, local GPU prefix cache (cumulative)
    prefix_cache_hits: float  # tokens hit (cumulative)
    prefix_cache_hit_ratio: float | None  # prefix_cache_hits / prefix_cache_queries (cumulative)
    prefix_cache_hit_ratio_window: float | None  # same over the scrape window
    external_prefix_cache_queries: float
    external_prefix_cache_hits: float
    external_prefix_cache_hit_ratio: float | None
    external_prefix_cache_hit_ratio_window: float | None
    prompt_tokens_cached: float
    cached_tokens_by_source: dict[str, float]  # source (device/host/p2p/disk/external_unspecified) -> tokens
    cached_tokens_by_source_per_s: dict[str, float]
    kv_cache_usage: float | None  # 0..1 of the GPU KV pool
    requests_running: float | None
    requests_waiting: float | None
    preemptions_total: float
    preemptions_per_s: float | None
    ttft: LatencySummary | None
    itl: LatencySummary | None
    e2e: LatencySummary | None


@dataclass(frozen=True, slots=True)
class VllmMetricsObservation(Observation):
    engines: tuple[EngineSample, ...]
    process_start_time: float | None
    unknown_families: tuple[str, ...]
    missing_families: tuple[str, ...]
    broken_blocks: int  # metric text blocks that failed to parse and were skipped


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """PromQL-style quantile from (upper bound, cumulative count) pairs sorted by bound; None where PromQL
    gives NaN (no observations, no +Inf bucket, fewer than two buckets)."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return buckets[-1][0]


@dataclass(slots=True)
class _Hist:
    t: float  # clock time the histogram was last seen
    buckets: dict[float, float]  # le -> cumulative count
    sum: float


@dataclass(slots=True)
class _Prev:
    """Last seen value and time of each series of one engine (carried across scrapes that lacked it)."""

    t: float  # time of the last scrape of this engine
    counters: dict[str, tuple[float, float]]  # sample name -> (value, time)
    by_source: dict[str, tuple[float, float]]
    hist: dict[str, _Hist]


def _key(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("model_name", ""), labels.get("engine", "0")


def _went_down(prev: _Prev, counters: dict[str, float], by_source: dict[str, float],
               hist: dict[str, _Hist]) -> bool:  # fmt: skip
    if any(v < prev.counters[n][0] for n, v in counters.items() if n in prev.counters):
        return True
    if any(v < prev.by_source[k][0] for k, v in by_source.items() if k in prev.by_source):
        return True
    for h, cur in hist.items():
        old = prev.hist.get(h)
        if old is not None and (
            cur.sum < old.sum or any(c < old.buckets.get(le, 0.0) for le, c in cur.buckets.items())
        ):
            return True
    return False


@dataclass(slots=True)
class VllmMetricsParser:
    """Pure, stateful (keeps the previous scrape per engine): text + time -> observation."""

    collector: str
    prev: dict[tuple[str, str], _Prev] = field(default_factory=dict)
    start_time: float | None = None

    def parse(self, text: str, now: float) -> VllmMetricsObservation:
        p = parse_families(text, keep=READ_SAMPLES)
        fams = {n for n in p.types if n.startswith("vllm:") and not n.endswith("_created")}
        if not fams and p.broken_blocks == 0:
            raise ValueError("no vllm: metric families in /metrics")
        start = next((s.value for s in p.get(START)), None)
        restarted = self.start_time is not None and start is not None and start != self.start_time
        if start is not None:
            self.start_time = start
        keys = sorted({_key(s.labels) for n in COUNTERS + (G_KV,) for s in p.get(n)})
        engines = tuple(self._engine(p, k, now, restarted) for k in keys)
        return VllmMetricsObservation(
            collector=self.collector,
            timestamp=now,
            engines=engines,
            process_start_time=start,
            unknown_families=tuple(sorted(f for f in fams if f not in KNOWN_FAMILIES)),
            missing_families=tuple(sorted(EXPECTED_FAMILIES - fams)),
            broken_blocks=p.broken_blocks,
        )

    def _engine(self, p: ParsedText, key: tuple[str, str], now: float, restarted: bool) -> EngineSample:
        def val(name: str) -> float | None:
            for s in p.get(name):
                if _key(s.labels) == key:
                    return float(s.value)
            return None

        counters = {n: v for n in COUNTERS if (v := val(n)) is not None}
        by_source = {
            s.labels.get("source", ""): float(s.value) for s in p.get(C_CACHED_SRC) if _key(s.labels) == key
        }
        hist: dict[str, _Hist] = {}
        for h in HISTOGRAMS:
            bks = {float(s.labels["le"]): float(s.value) for s in p.get(h + "_bucket")
                   if _key(s.labels) == key and "le" in s.labels}  # fmt: skip
            if bks:
                sm = next((float(s.value) for s in p.get(h + "_sum") if _key(s.labels) == key), 0.0)
                hist[h] = _Hist(t=now, buckets=bks, sum=sm)
        prev = self.prev.get(key)
        reset = restarted or (prev is not None and _went_down(prev, counters, by_source, hist))
        dt = (now - prev.t) if prev is not None else None
        base = prev if prev is not None and not reset else _Prev(t=now, counters={}, by_source={}, hist={})
        self.prev[key] = _Prev(
            t=now,
            counters={**base.counters, **{n: (v, now) for n, v in counters.items()}},
            by_source={**base.by_source, **{k: (v, now) for k, v in by_source.items()}},
            hist={**base.hist, **hist},
        )

        def delta(cur: float | None, old: tuple[float, float] | None) -> tuple[float, float] | None:
            """(increase, seconds) since ``old`` was seen; at a restart since the previous scrape, from 0."""
            if prev is None or cur is None or dt is None:
                return None
            if reset:
                return cur, dt
            return (cur - old[0], now - old[1]) if old is not None else None

        def d(name: str) -> tuple[float, float] | None:
            return delta(counters.get(name), prev.counters.get(name) if prev is not None else None)

        def per_s(x: tuple[float, float] | None) -> float | None:
            return x[0] / x[1] if x is not None and x[1] > 0 else None

        def ratio(h: float | None, q: float | None) -> float | None:
            return h / q if h is not None and q else None

        def window_ratio(hits: str, queries: str) -> float | None:
            dh, dq = d(hits), d(queries)
            if dh is None or dq is None or dh[1] != dq[1]:  # different spans (one was carried): undefined
                return None
            return ratio(dh[0], dq[0])

        def lat(h: str) -> LatencySummary | None:
            cur = hist.get(h)
            if cur is None:
                return None
            old = prev.hist.get(h) if prev is not None and not reset else None
            if prev is not None and not reset and old is None:
                return None  # never seen since the engine's (re)start: the window is unknown
            old_b = old.buckets if old is not None else {}
            bks = sorted((le, c - old_b.get(le, 0.0)) for le, c in cur.buckets.items())
            count = bks[-1][1]
            s = cur.sum - (old.sum if old is not None else 0.0)
            return LatencySummary(
                count=count,
                mean=s / count if count else None,
                p50=histogram_quantile(0.5, bks),
                p90=histogram_quantile(0.9, bks),
                p99=histogram_quantile(0.99, bks),
            )

        src_rate: dict[str, float] = {}
        for k, v in by_source.items():
            r = per_s(delta(v, prev.by_source.get(k) if prev is not None else None))
            if r is not None:
                src_rate[k] = r
        return EngineSample(
            model=key[0],
            engine=key[1],
            interval_s=dt,
            restarted=bool(reset),
            prompt_tokens_total=counters.get(C_PROMPT, 0.0),
            generation_tokens_total=counters.get(C_GEN, 0.0),
            prompt_tokens_per_s=per_s(d(C_PROMPT)),
            generation_tokens_per_s=per_s(d(C_GEN)),
            prefix_cache_queries=counters.get(C_PC_Q, 0.0),
            prefix_cache_hits=counters.get(C_PC_H, 0.0),
            prefix_cache_hit_ratio=ratio(counters.get(C_PC_H), counters.get(C_PC_Q)),
            prefix_cache_hit_ratio_window=window_ratio(C_PC_H, C_PC_Q),
            external_prefix_cache_queries=counters.get(C_EPC_Q, 0.0),
            external_prefix_cache_hits=counters.get(C_EPC_H, 0.0),
            external_prefix_cache_hit_ratio=ratio(counters.get(C_EPC_H), counters.get(C_EPC_Q)),
            external_prefix_cache_hit_ratio_window=window_ratio(C_EPC_H, C_EPC_Q),
            prompt_tokens_cached=counters.get(C_CACHED, 0.0),
            cached_tokens_by_source=by_source,
            cached_tokens_by_source_per_s=src_rate,
            kv_cache_usage=val(G_KV),
            requests_running=val(G_RUN),
            requests_waiting=val(G_WAIT),
            preemptions_total=counters.get(C_PREEMPT, 0.0),
            preemptions_per_s=per_s(d(C_PREEMPT)),
            ttft=lat(H_TTFT),
            itl=lat(H_ITL),
            e2e=lat(H_E2E),
        )


class VllmMetricsCollector(HttpCollector[VllmMetricsObservation]):
    """Scrapes one vLLM API server's ``/metrics`` (all its DP engines)."""

    kind = "vllm_metrics"
    path = "/metrics"

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        client: httpx.AsyncClient,
        registry: CollectorRegistry,
        clock: Clock = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        super().__init__(name, base_url, client=client, registry=registry, clock=clock, timeout_s=timeout_s)
        self.parser = VllmMetricsParser(collector=name)
        self._families = _family_gauge(registry)

    def parse(self, raw: str, now: float) -> VllmMetricsObservation:
        obs = self.parser.parse(raw, now)
        self._families.labels(collector=self.name, state="unknown").set(len(obs.unknown_families))
        self._families.labels(collector=self.name, state="missing").set(len(obs.missing_families))
        if obs.broken_blocks:
            self.count_error("metrics_text", f"{obs.broken_blocks} unparsable block(s) in /metrics skipped")
        return obs


# one gauge per registry; weak keys (an id() key was reused by later registries, which then got no gauge)
_fam_gauges: weakref.WeakKeyDictionary[CollectorRegistry, Gauge] = weakref.WeakKeyDictionary()


def _family_gauge(registry: CollectorRegistry) -> Gauge:
    g = _fam_gauges.get(registry)
    if g is None:
        g = Gauge(
            "kvtier_vllm_metric_families",
            "vllm: families unknown to kvtier, or expected but absent (missing), at the last scrape.",
            ["collector", "state"],
            registry=registry,
        )
        _fam_gauges[registry] = g
    return g
