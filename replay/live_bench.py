"""``kvtier bench``: a live A/B harness against a real OpenAI-compatible engine and its KV-cache layer.

It replays a Mooncake-format trace against ``--engine-url`` and reports, per arm (``baseline`` = no sidecar,
``shadow``, ``active``), client-side TTFT, throughput and the hit tokens by source, read from the engine's and
the cache layer's own Prometheus counters before and after each run (the figures are the layer's, not ours).

Prompt recipe (why: shared hash prefixes must become shared token prefixes, chunk-aligned with the cache
layer): every ``hash_id`` becomes a deterministic chunk of ``chunk_tokens`` token ids drawn from a generator
seeded by ``(seed, hash_id)``; a prompt is the concatenation of its request's chunks, capped at
``max_prompt_tokens`` (whole chunks only). Prompts go out as token-id lists (``/v1/completions``), so no
tokenizer is involved and the token prefix is exact.

Hit tokens by source (all deltas over one run, tokens):
- ``gpu_hit_tokens``: vLLM's local prefix cache (``vllm:prefix_cache_hits``);
- ``external_hit_tokens``: vLLM's external (connector) hits (``vllm:external_prefix_cache_hits``);
- ``l1_hit_tokens`` / ``l2_hit_tokens``: LMCache MP lookup hits served from L1 / L2
  (``lmcache_mp_lookup_hit_l{1,2}_tokens``);
- ``hit_tokens_total`` = gpu + external; ``recomputed_tokens`` = prompt tokens - hit_tokens_total.

Also per run: ``cache_layer_cpu_s`` and ``engine_api_cpu_s``, the CPU seconds of the cache layer's server and
of the engine's API server process (their ``process_cpu_seconds_total``; the engine core and workers are
other processes), and the sidecar's own (``sidecar_cpu_s_per_1k_requests``): on a host the engine shares,
what the sidecar and the work its calls cause in the peers cost. Each arm's ``per_run`` keeps every run's
figures in run order (counters, TTFT mean, wall time, sidecar CPU), so series of several invocations can be
pooled.

Statistics: TTFT CIs are two-stage percentile bootstraps (an arm's runs, then the requests of each drawn
run), because the host drifts between runs and a run's requests share its minutes; with one run per arm
they are request-level and blind to drift. Counter CIs are bootstraps over runs (a single run gives a
degenerate interval: its value twice). Ratios to baseline resample both arms the same way. Every interval
is widened about its estimate by :func:`small_sample_factor` of the sample sizes resampled: a plain
percentile bootstrap over 3 runs per arm covers the true ratio about 80 % of the time, not 95 %.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats as sps

from kvtier.collectors.promtext import parse_families
from kvtier.policies.base import Request

ARMS = ("baseline", "shadow", "active")


def parse_arms(spec: str, arm_args: Sequence[str] = ()) -> tuple[list[str], dict[str, list[str]]]:
    """``--arms`` and ``--arm-args`` -> (arm labels, extra sidecar flags per label); ValueError on a typo.

    An arm is a mode of :data:`ARMS` or a variant ``MODE/NAME`` of shadow or active (``active/p8``), so
    that configurations of the sidecar run interleaved in the same minutes against one baseline instead
    of in separate invocations an hour apart. ``arm_args`` items are ``LABEL=FLAGS`` (shell-split), added
    to the common sidecar flags for that arm's runs only; every label must be one of the arms."""
    arms = [a.strip() for a in spec.split(",") if a.strip()]
    if not arms:
        raise ValueError("no arm given; choose from " + ", ".join(ARMS))
    for a in arms:
        mode, sep, name = a.partition("/")
        if mode not in ARMS or (sep and (mode == "baseline" or not name)):
            raise ValueError(f"unknown arm {a!r}: choose from {', '.join(ARMS)}, shadow/NAME, active/NAME")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arm given twice in {spec!r}")
    extra: dict[str, list[str]] = {}
    for item in arm_args:
        label, eq, flags = item.partition("=")
        label = label.strip()
        if not eq or label not in arms or label == "baseline":
            sidecars = [a for a in arms if a != "baseline"]
            raise ValueError(f"--arm-args {item!r}: LABEL=FLAGS, LABEL one of the sidecar arms {sidecars}")
        extra.setdefault(label, []).extend(shlex.split(flags))
    return arms, extra


_TOKEN_LO = 10  # skip the lowest ids (special tokens of most vocabularies)

# ---------------------------------------------------------------------------------------------------------
# prompts


def chunk_tokens(hash_id: int, chunk: int, *, vocab: int, seed: int = 0) -> list[int]:
    """The ``chunk`` token ids that stand for one trace ``hash_id`` (pure, deterministic)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, int(hash_id) & 0xFFFFFFFFFFFFFFFF])
    return [int(t) for t in rng.integers(_TOKEN_LO, max(vocab, _TOKEN_LO + 1), size=chunk)]


def build_prompt(
    hash_ids: Sequence[int] | np.ndarray, *, chunk: int, vocab: int, max_prompt_tokens: int, seed: int = 0
) -> list[int]:
    """Token ids of one request: its chunks in order, whole chunks only, at most ``max_prompt_tokens``."""
    n = max(1, max_prompt_tokens // chunk)
    out: list[int] = []
    for h in list(hash_ids)[:n]:
        out.extend(chunk_tokens(int(h), chunk, vocab=vocab, seed=seed))
    return out


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: arrival offset (s, already scaled) and its prompt token ids."""

    at_s: float
    prompt: list[int]
    max_tokens: int


def build_requests(
    trace: Sequence[Request],
    *,
    chunk: int,
    vocab: int,
    max_prompt_tokens: int,
    max_tokens: int = 2,
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Trace -> requests; ``time_scale`` divides the trace's inter-arrival times (2 = twice as fast)."""
    if not trace:
        return []
    t0 = float(trace[0].timestamp_ms)
    return [
        BenchRequest(
            (float(r.timestamp_ms) - t0) / 1000.0 / max(time_scale, 1e-9),
            build_prompt(
                [int(h) for h in r.hash_ids],
                chunk=chunk,
                vocab=vocab,
                max_prompt_tokens=max_prompt_tokens,
                seed=seed,
            ),
            max(1, min(max_tokens, int(r.output_length) or 1)),
        )
        for r in trace
    ]


def distinct_chunks(trace: Sequence[Request], *, chunk: int, max_prompt_tokens: int) -> int:
    """Distinct (prefix) chunks the workload stores: each hash_id stands for its whole prefix."""
    n = max(1, max_prompt_tokens // chunk)
    return len({int(h) for r in trace for h in list(r.hash_ids)[:n]})


def engine_max_len(engine_url: str, timeout_s: float = 10.0) -> int | None:
    """The engine's context length (vLLM's ``/v1/models`` ``max_model_len``), or None when not reported."""
    try:
        data = httpx.get(engine_url.rstrip("/") + "/v1/models", timeout=timeout_s).json()["data"]
        return int(data[0]["max_model_len"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None


def prompt_cap(max_prompt_tokens: int, max_len: int | None, max_tokens: int) -> int:
    """Prompt tokens that fit: the user's cap, and the model's length minus the output tokens."""
    return max_prompt_tokens if max_len is None else max(1, min(max_prompt_tokens, max_len - max_tokens))


# ---------------------------------------------------------------------------------------------------------
# statistics (pure)


def _mean(a: np.ndarray) -> float:
    return float(np.mean(a))


def small_sample_factor(*sizes: int, alpha: float = 0.05) -> float:
    """How much wider than its percentile bootstrap an interval from samples of these ``sizes`` must be.

    Two small-sample errors of the plain bootstrap, both large at the 3-5 runs per arm a live A/B affords:
    its variance is ``(n - 1) / n`` of the unbiased one (a factor ``sqrt(n / (n - 1))`` on the width, from
    the smallest sample), and its tails are normal where Student's ``t`` with ``sum(n - 1)`` degrees of
    freedom holds (``t / z``). Together 1.73 for 3 runs against 3, 1.33 for four series of 3 against 3,
    about 1.01 for 200 requests. Measured: the widened interval covers a known ratio in about 95 % of
    samples of 3 runs per arm (tests/replay/test_live_bench.py), the plain one in about 80 %. 1.0 when a
    sample has fewer than 2 values (there is no spread to correct)."""
    if not sizes or min(sizes) < 2:
        return 1.0
    n = min(sizes)
    df = sum(k - 1 for k in sizes)
    q = 1 - alpha / 2
    return math.sqrt(n / (n - 1)) * float(sps.t.ppf(q, df)) / float(sps.norm.ppf(q))


def widen(
    ci: tuple[float, float], estimate: float, factor: float, *, log: bool = False
) -> tuple[float, float]:
    """``ci`` stretched by ``factor`` about ``estimate`` (on the log scale for ratios, so a ratio's interval
    stays positive and as wide either way in relative terms); unchanged where any part is not finite."""
    lo, hi = ci
    if factor == 1.0 or not all(map(math.isfinite, (lo, hi, estimate))):
        return ci
    if log:
        if min(lo, hi, estimate) <= 0:
            return ci
        return (estimate * (lo / estimate) ** factor, estimate * (hi / estimate) ** factor)
    return (estimate - factor * (estimate - lo), estimate + factor * (hi - estimate))


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    stat: Callable[[np.ndarray], float] = _mean,
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap ``(lo, hi)`` of ``stat`` over ``values``, widened for the sample's size
    (:func:`small_sample_factor`); ``(nan, nan)`` when empty."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return (math.nan, math.nan)
    if a.size == 1:
        return (float(a[0]), float(a[0]))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_boot, a.size))
    boots = a[idx].mean(axis=1) if stat is _mean else np.array([stat(a[i]) for i in idx])
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return widen((float(lo), float(hi)), stat(a), small_sample_factor(a.size, alpha=alpha))


def bootstrap_ratio_ci(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    stat: Callable[[np.ndarray], float] = _mean,
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``stat(a) / stat(b)`` (independent resamples of a and b), widened on the
    log scale for the samples' sizes (:func:`small_sample_factor`)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size == 0 or y.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    ratios = np.empty(n_boot)
    for i in range(n_boot):
        den = stat(y[rng.integers(0, y.size, y.size)])
        num = stat(x[rng.integers(0, x.size, x.size)])
        ratios[i] = _safe_ratio(num, den)
    est = _safe_ratio(stat(x), stat(y))
    return widen(_percentiles(ratios, alpha), est, small_sample_factor(x.size, y.size, alpha=alpha), log=True)


def _safe_ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _percentiles(boots: np.ndarray, alpha: float) -> tuple[float, float]:
    """``(lo, hi)``: the ``alpha/2`` and ``1 - alpha/2`` quantiles of the finite bootstrap values."""
    boots = boots[np.isfinite(boots)]
    if boots.size == 0:
        return (math.nan, math.nan)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return (float(lo), float(hi))


def _two_stage(runs: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """One two-stage resample: runs with replacement, then each drawn run's values with replacement."""
    pick = rng.integers(0, len(runs), len(runs))
    return np.concatenate([runs[j][rng.integers(0, runs[j].size, runs[j].size)] for j in pick])


def _runs(runs: Sequence[Sequence[float] | np.ndarray]) -> list[np.ndarray]:
    return [a for a in (np.asarray(r, dtype=float) for r in runs) if a.size]


def run_bootstrap_ci(
    runs: Sequence[Sequence[float] | np.ndarray],
    stat: Callable[[np.ndarray], float] = _mean,
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile CI of ``stat`` over per-request values grouped by run, from a two-stage bootstrap (runs,
    then requests within each drawn run). Why: the host's speed drifts between runs, so the requests of
    one run are not independent of each other; pooling them (:func:`bootstrap_ci`) gives an interval as
    narrow as if every request had its own minute. The two-stage resample carries the run-to-run spread
    and is conservative when there is none (it counts the within-run spread twice). One run: the
    request-level interval, which says nothing about drift. ``(nan, nan)`` when there are no values."""
    rs = _runs(runs)
    if not rs:
        return (math.nan, math.nan)
    if len(rs) == 1:
        return bootstrap_ci(rs[0], stat, n_boot=n_boot, alpha=alpha, seed=seed)
    rng = np.random.default_rng(seed)
    ci = _percentiles(np.array([stat(_two_stage(rs, rng)) for _ in range(n_boot)]), alpha)
    return widen(ci, stat(np.concatenate(rs)), small_sample_factor(len(rs), alpha=alpha))


def run_bootstrap_ratio_ci(
    a_runs: Sequence[Sequence[float] | np.ndarray],
    b_runs: Sequence[Sequence[float] | np.ndarray],
    stat: Callable[[np.ndarray], float] = _mean,
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile CI of ``stat(a) / stat(b)`` with both arms resampled in two stages (see
    :func:`run_bootstrap_ci`), widened for the numbers of runs; with one run per arm it is the
    request-level :func:`bootstrap_ratio_ci`."""
    xa, xb = _runs(a_runs), _runs(b_runs)
    if not xa or not xb:
        return (math.nan, math.nan)
    if len(xa) == 1 and len(xb) == 1:
        return bootstrap_ratio_ci(xa[0], xb[0], stat, n_boot=n_boot, alpha=alpha, seed=seed)
    rng = np.random.default_rng(seed)
    ratios = np.empty(n_boot)
    for i in range(n_boot):
        den = stat(_two_stage(xb, rng))
        num = stat(_two_stage(xa, rng))
        ratios[i] = _safe_ratio(num, den)
    est = _safe_ratio(stat(np.concatenate(xa)), stat(np.concatenate(xb)))
    factor = small_sample_factor(len(xa), len(xb), alpha=alpha)
    return widen(_percentiles(ratios, alpha), est, factor, log=True)


def _q(p: float) -> Callable[[np.ndarray], float]:
    return lambda a: float(np.quantile(a, p))


# ---------------------------------------------------------------------------------------------------------
# counters


def scrape_counters(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``GET url/metrics`` -> {sample name: value summed over label sets}; {} when unreachable."""
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return {}
    p = parse_families(text)
    out: dict[str, float] = {}
    for name, samples in p.samples.items():
        out[name] = float(sum(s.value for s in samples))
    return out


def scrape_labelled(
    url: str, name: str, timeout_s: float = 10.0, label: str | None = None
) -> dict[str, float]:
    """One counter's samples keyed by its ``label`` value, or by ``action/outcome`` labels
    (kvtier_actuations_total) when no label is named."""
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for s in parse_families(text).get(name):
        k = (
            s.labels.get(label, "?")
            if label
            else f"{s.labels.get('action', '?')}/{s.labels.get('outcome', '?')}"
        )
        out[k] = out.get(k, 0.0) + s.value
    return out


def _d(after: Mapping[str, float], before: Mapping[str, float], *names: str) -> float:
    for n in names:
        if n in after:
            return after[n] - before.get(n, 0.0)
    return 0.0


def counter_deltas(
    eng0: Mapping[str, float], eng1: Mapping[str, float], lmc0: Mapping[str, float], lmc1: Mapping[str, float]
) -> dict[str, float]:
    """Hit tokens by source over one run (see module doc), tokens."""
    prompt = _d(eng1, eng0, "vllm:prompt_tokens_total")
    gpu = _d(eng1, eng0, "vllm:prefix_cache_hits_total")
    ext = _d(eng1, eng0, "vllm:external_prefix_cache_hits_total")
    return {
        "prompt_tokens": prompt,
        "gpu_hit_tokens": gpu,
        "external_hit_tokens": ext,
        "hit_tokens_total": gpu + ext,
        "recomputed_tokens": max(0.0, prompt - gpu - ext),
        "l1_hit_tokens": _d(lmc1, lmc0, "lmcache_mp_lookup_hit_l1_tokens_total"),
        "l2_hit_tokens": _d(lmc1, lmc0, "lmcache_mp_lookup_hit_l2_tokens_total"),
        "l2_prefetch_chunks": _d(lmc1, lmc0, "lmcache_mp_l2_prefetch_load_completed_chunks_total"),
        "l1_evicted_chunks": _d(lmc1, lmc0, "lmcache_mp_l1_evicted_chunks_total"),
        # stores a full L1 refused, and L2 hits lost for want of L1 staging room (or contention)
        "l1_allocation_failure_chunks": _d(lmc1, lmc0, "lmcache_mp_l1_allocation_failure_chunks_total"),
        "l2_prefetch_failure_chunks": _d(lmc1, lmc0, "lmcache_mp_l2_prefetch_failure_chunks_total"),
        # CPU seconds of the cache layer's server and the engine's API server process (each exports its own
        # process collector): what a sidecar's calls cost the peers it talks to
        "cache_layer_cpu_s": _d(lmc1, lmc0, CPU),
        "engine_api_cpu_s": _d(eng1, eng0, CPU),
    }


# ---------------------------------------------------------------------------------------------------------
# sending


@dataclass(slots=True)
class RunResult:
    """One run of one arm."""

    arm: str
    ttft_s: list[float] = field(default_factory=list)
    failed: int = 0
    wall_s: float = 0.0
    prompt_tokens_sent: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    actuations: dict[str, float] = field(default_factory=dict)
    guard: dict[str, float] = field(default_factory=dict)
    # per request, in send order: when it was sent and when its first token came (s from the run's start;
    # NaN when it failed) -- the arrival process a simulator can replay against the layer's own clocks
    sent_at_s: list[float] = field(default_factory=list)
    first_token_at_s: list[float] = field(default_factory=list)
    started_perf_s: float = math.nan  # the run's start on time.perf_counter's clock
    sidecar_cpu_s: float = math.nan  # CPU seconds the sidecar used during the run (its process_cpu_seconds)


async def _one(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, t0: float | None = None
) -> float | None:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter() if t0 is None else t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return None
            first: float | None = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data:") and "[DONE]" not in line:
                    first = time.perf_counter() - t0
            return first
    except httpx.HTTPError:
        return None


async def send_all(
    engine_url: str,
    model: str,
    reqs: Sequence[BenchRequest],
    *,
    concurrency: int | None,
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
    times: list[tuple[float, float]] | None = None,
    start: list[float] | None = None,
) -> tuple[list[float], int, float]:
    """Send every request; ``concurrency`` None = at the scaled timestamps. -> (ttfts s, failed, wall s).
    ``times``, when given, receives per request (sent at, first token at), s from the start (NaN: failed);
    ``start`` receives the start itself on ``time.perf_counter``'s clock, so that other observations can be
    put on the same clock."""
    url = engine_url.rstrip("/")
    ttfts: list[float | None] = [None] * len(reqs)
    sent = [math.nan] * len(reqs)
    limits = httpx.Limits(max_connections=max(concurrency or 64, 1) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        if start is not None:
            start[:] = [t0]
        if concurrency:
            sem = asyncio.Semaphore(concurrency)

            async def run(i: int) -> None:
                async with sem:
                    ts = time.perf_counter()
                    sent[i] = ts - t0
                    ttfts[i] = await _one(client, url, model, reqs[i], ts)
                on_done()

        else:

            async def run(i: int) -> None:
                delay = reqs[i].at_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing to the trace clock, not synchronisation
                ts = time.perf_counter()
                sent[i] = ts - t0
                ttfts[i] = await _one(client, url, model, reqs[i], ts)
                on_done()

        await asyncio.gather(*(run(i) for i in range(len(reqs))))
        wall = time.perf_counter() - t0
    if times is not None:
        times[:] = [(s_, s_ + t if t is not None else math.nan) for s_, t in zip(sent, ttfts, strict=True)]
    ok = [t for t in ttfts if t is not None]
    return ok, len(ttfts) - len(ok), wall


# ---------------------------------------------------------------------------------------------------------
# sidecar


@dataclass
class SidecarProcess:
    """``kvtier serve --mode <arm> --listen 127.0.0.1:<port> <args>`` started and stopped by the bench."""

    args: list[str]
    mode: str
    port: int
    log: Path
    exe: list[str] = field(default_factory=lambda: ["kvtier"])
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> SidecarProcess:
        cmd = [*self.exe, "serve", "--mode", self.mode, "--listen", f"127.0.0.1:{self.port}", *self.args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling readiness with a deadline
        self.stop()
        raise RuntimeError(f"sidecar not ready in {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------------------------------------------------
# one run, and the A/B over runs


@dataclass
class Target:
    """Where a run goes: engine + cache layer URLs (and the sidecar's, when one is up)."""

    engine_url: str
    lmcache_url: str | None
    model: str
    sidecar_url: str | None = None


def run_once(
    arm: str,
    target: Target,
    reqs: Sequence[BenchRequest],
    *,
    concurrency: int | None,
    on_done: Callable[[], None] = lambda: None,
) -> RunResult:
    """Scrape, send every request, let the engine settle, scrape again."""
    eng0 = scrape_counters(target.engine_url)
    lmc0 = scrape_counters(target.lmcache_url) if target.lmcache_url else {}
    act0 = scrape_labelled(target.sidecar_url, "kvtier_actuations_total") if target.sidecar_url else {}
    g0 = _sidecar_counters(target.sidecar_url)
    times: list[tuple[float, float]] = []
    start: list[float] = []
    ttfts, failed, wall = asyncio.run(send_all(target.engine_url, target.model, reqs, concurrency=concurrency,
                                               on_done=on_done, times=times, start=start))  # fmt: skip
    eng1 = scrape_counters(target.engine_url)
    lmc1 = scrape_counters(target.lmcache_url) if target.lmcache_url else {}
    act1 = scrape_labelled(target.sidecar_url, "kvtier_actuations_total") if target.sidecar_url else {}
    g1 = _sidecar_counters(target.sidecar_url)
    cpu_s = g1.pop(CPU, math.nan) - g0.pop(CPU, math.nan)
    return RunResult(
        arm=arm,
        ttft_s=ttfts,
        failed=failed,
        wall_s=wall,
        prompt_tokens_sent=sum(len(r.prompt) for r in reqs),
        counters=counter_deltas(eng0, eng1, lmc0, lmc1),
        actuations={k: v - act0.get(k, 0.0) for k, v in act1.items() if v - act0.get(k, 0.0)},
        guard={k: v - g0.get(k, 0.0) for k, v in g1.items()},
        sent_at_s=[a for a, _ in times],
        first_token_at_s=[b for _, b in times],
        started_perf_s=start[0] if start else math.nan,
        sidecar_cpu_s=cpu_s,
    )


CPU = "process_cpu_seconds_total"  # a process's own CPU seconds (prometheus_client's process collector)


def _sidecar_counters(url: str | None) -> dict[str, float]:
    """The sidecar's guard and L1-keeper counters and its process CPU seconds (``CPU``; NaN when not
    exported); {} without a sidecar. Why the CPU: on a host the engine shares, it is the sidecar's presence
    cost."""
    if not url:
        return {}
    c = scrape_counters(url)
    out = {
        k: v
        for k, v in c.items()
        if k.startswith(("kvtier_guard_", "kvtier_l1_keeper_")) and k.endswith("_total")
    }
    out[CPU] = c.get(CPU, math.nan)
    for name, label in (("kvtier_guard_windows_total", "verdict"), ("kvtier_guard_measured_periods_total",
                        "verdict"), ("kvtier_guard_latency_periods_total", "why")):  # fmt: skip
        for k, v in scrape_labelled(url, name, label=label).items():
            out[f"{name}{{{label}={k}}}"] = v
    return out


RUN_FIELDS = ("l2_prefetch_chunks", "cache_layer_cpu_s", "engine_api_cpu_s")  # per run, no ratio
HIT_FIELDS = ("hit_tokens_total", "gpu_hit_tokens", "external_hit_tokens", "l1_hit_tokens", "l2_hit_tokens",
              "recomputed_tokens")  # fmt: skip


def summarize(runs: Sequence[RunResult], baseline: Sequence[RunResult] | None = None) -> dict[str, Any]:
    """Per-arm figures (see module doc); ``ratio_to_baseline`` with CIs when baseline runs are given."""
    by_run = [r.ttft_s for r in runs]
    ttft = [t for r in runs for t in r.ttft_s]
    n_req = sum(len(r.ttft_s) + r.failed for r in runs)
    wall = sum(r.wall_s for r in runs)
    tok = sum(r.prompt_tokens_sent for r in runs)
    per_run = {f: [r.counters.get(f, 0.0) for r in runs] for f in (*HIT_FIELDS, *RUN_FIELDS)}
    tput = [r.prompt_tokens_sent / r.wall_s for r in runs if r.wall_s > 0]
    a = np.asarray(ttft) if ttft else np.asarray([math.nan])
    out: dict[str, Any] = {
        "runs": len(runs),
        "requests": n_req,
        "failed": sum(r.failed for r in runs),
        "ttft_mean_s": float(np.mean(a)),
        "ttft_p50_s": float(np.quantile(a, 0.5)),
        "ttft_p90_s": float(np.quantile(a, 0.9)),
        "ttft_p99_s": float(np.quantile(a, 0.99)),
        "requests_per_s": n_req / wall if wall else math.nan,
        "throughput_tokens_per_s": tok / wall if wall else math.nan,
        "sidecar_cpu_s_per_1k_requests": (
            1000 * sum(r.sidecar_cpu_s for r in runs) / n_req if n_req and runs else math.nan
        ),
        **{f: float(np.mean(v)) for f, v in per_run.items()},  # per run (mean over runs)
        # each run's figures, in run order: what pools series of several invocations (counters above, and
        # each run's TTFT mean, wall time and sidecar CPU seconds)
        "per_run": {
            **per_run,
            "ttft_mean_s": [statistics.fmean(r.ttft_s) if r.ttft_s else math.nan for r in runs],
            "wall_s": [r.wall_s for r in runs],
            "sidecar_cpu_s": [r.sidecar_cpu_s for r in runs],
        },
        "actuations": _sum_dicts([r.actuations for r in runs]),
        "guard": _sum_dicts([r.guard for r in runs]),
        "ci95": {
            "ttft_mean_s": run_bootstrap_ci(by_run),
            "ttft_p50_s": run_bootstrap_ci(by_run, _q(0.5), n_boot=500),
            "ttft_p99_s": run_bootstrap_ci(by_run, _q(0.99), n_boot=500),
            "throughput_tokens_per_s": bootstrap_ci(tput),
            **{f: bootstrap_ci(v) for f, v in per_run.items()},
        },
    }
    if baseline:
        bt = [t for r in baseline for t in r.ttft_s]
        ratios: dict[str, Any] = {"ttft_mean_s": _ratio(ttft, bt)}
        ci: dict[str, tuple[float, float]] = {
            "ttft_mean_s": run_bootstrap_ratio_ci(by_run, [r.ttft_s for r in baseline])
        }
        for f in HIT_FIELDS:
            b = [r.counters.get(f, 0.0) for r in baseline]
            ratios[f] = _ratio(per_run[f], b)
            ci[f] = bootstrap_ratio_ci(per_run[f], b)
        out["ratio_to_baseline"] = ratios
        out["ratio_ci95"] = ci
    return out


def _ratio(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    mb = float(np.mean(b)) if len(b) else math.nan
    return float(np.mean(a)) / mb if mb else math.nan


def _sum_dicts(ds: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def interleave(arms: Sequence[str], repeat: int) -> list[str]:
    """Run order: arm order rotates each repetition (A B C, B C A, ...) so drift hits every arm alike."""
    out: list[str] = []
    for i in range(repeat):
        k = i % len(arms)
        out.extend([*arms[k:], *arms[:k]])
    return out


def render_table(arms: dict[str, dict[str, Any]]) -> Any:
    """A rich table of the per-arm summaries."""
    from rich.table import Table

    t = Table(title="kvtier bench (ci95 in brackets; x = ratio to baseline)")
    t.add_column("figure")
    for a in arms:
        t.add_column(a, justify="right")
    rows = [
        ("requests", "requests", "{:.0f}"),
        ("failed", "failed", "{:.0f}"),
        ("TTFT mean s", "ttft_mean_s", "{:.3f}"),
        ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
        ("TTFT p90 s", "ttft_p90_s", "{:.3f}"),
        ("TTFT p99 s", "ttft_p99_s", "{:.3f}"),
        ("req/s", "requests_per_s", "{:.2f}"),
        ("prompt tok/s", "throughput_tokens_per_s", "{:.0f}"),
        ("hit tokens (gpu+ext)", "hit_tokens_total", "{:.0f}"),
        ("  gpu prefix", "gpu_hit_tokens", "{:.0f}"),
        ("  external", "external_hit_tokens", "{:.0f}"),
        ("LMCache L1 hit tok", "l1_hit_tokens", "{:.0f}"),
        ("LMCache L2 hit tok", "l2_hit_tokens", "{:.0f}"),
        ("recomputed tok", "recomputed_tokens", "{:.0f}"),
        ("L2 prefetch chunks", "l2_prefetch_chunks", "{:.0f}"),
        ("cache layer CPU s", "cache_layer_cpu_s", "{:.1f}"),
        ("engine API CPU s", "engine_api_cpu_s", "{:.1f}"),
        ("sidecar CPU s/1k req", "sidecar_cpu_s_per_1k_requests", "{:.2f}"),
    ]
    for label, key, fmt in rows:
        cells = []
        for s in arms.values():
            v = s.get(key, math.nan)
            cell = fmt.format(v)
            ci = s.get("ci95", {}).get(key)
            if ci and key not in ("requests", "failed"):
                cell += f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"
            r = s.get("ratio_to_baseline", {}).get(key)
            if r is not None and math.isfinite(r):
                cell += f" x{r:.3f}"
            cells.append(cell)
        t.add_row(label, *cells)
    t.add_row("actuations", *[_counts_cell(s["actuations"]) for s in arms.values()])
    t.add_row("guard", *[_counts_cell(s["guard"]) for s in arms.values()])
    return t


def _counts_cell(counts: Mapping[str, float]) -> str:
    """One ``name value`` per line, names without the ``kvtier_`` prefix and ``_total`` suffix they share,
    and a label as ``:value`` (``guard_windows:pays``), so a cell stays readable in a column a few dozen
    characters wide."""
    if not counts:
        return "-"
    short = {
        re.sub(r"\{[^=}]+=([^}]*)\}", r":\1", k.removeprefix("kvtier_").replace("_total", "", 1)): v
        for k, v in counts.items()
    }
    return "\n".join(f"{k} {v:.0f}" for k, v in sorted(short.items()))


def table_console() -> Any:
    """The console the report table prints on: the terminal's width, or 200 columns when the output goes to
    a file or pipe (rich's 80 would cut a table of five arms into ellipses)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


@dataclass
class BenchPlan:
    """Everything one ``kvtier bench`` invocation does."""

    target: Target
    reqs: list[BenchRequest]
    arms: list[str]
    repeat: int = 1
    concurrency: int | None = 1
    sidecar_args: list[str] | Callable[[], list[str]] = field(default_factory=list)  # callable: per run
    sidecar_url: str | None = None  # use a running sidecar (its mode is the user's business)
    arm_args: dict[str, list[str]] = field(default_factory=dict)  # extra sidecar flags of one arm (variants)
    reset_cmd: str | None = None  # shell command run before each run (fresh engine/cache)
    workdir: Path = Path(".kvtier-bench")
    sidecar_exe: list[str] = field(default_factory=lambda: ["kvtier"])
    before_run: Callable[[str, int], Target | None] | None = None  # hook: (arm, i) -> fresh target or None
    after_run: Callable[[str, int], None] | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bench(plan: BenchPlan, progress: Any = None) -> dict[str, Any]:
    """Interleaved runs of every arm; -> ``{"arms": {arm: summary}, "order": [...], ...}``."""
    if plan.arm_args and plan.sidecar_url is not None:
        raise ValueError("per-arm sidecar flags need sidecars the bench starts, not --sidecar-url")
    order = interleave(plan.arms, plan.repeat)
    runs: dict[str, list[RunResult]] = {a: [] for a in plan.arms}
    task = progress.add_task("bench", total=len(order) * len(plan.reqs)) if progress else None
    for i, arm in enumerate(order):
        if plan.reset_cmd:
            subprocess.run(shlex.split(plan.reset_cmd), check=True)
        target = plan.target
        if plan.before_run:
            target = plan.before_run(arm, i) or target
        side: SidecarProcess | None = None
        try:
            if arm != "baseline" and plan.sidecar_url is None:
                args = plan.sidecar_args() if callable(plan.sidecar_args) else plan.sidecar_args
                log_name = f"sidecar_{i}_{arm.replace('/', '_')}.log"
                side = SidecarProcess(
                    [*args, *plan.arm_args.get(arm, [])], arm.partition("/")[0], free_port(),
                    plan.workdir / log_name, exe=plan.sidecar_exe,
                ).start()  # fmt: skip
            surl = plan.sidecar_url if arm != "baseline" else None
            t = Target(target.engine_url, target.lmcache_url, target.model, side.url if side else surl)
            if progress is not None:
                progress.update(task, description=f"run {i + 1}/{len(order)} {arm}")
            done = (lambda: progress.advance(task)) if progress else (lambda: None)
            r = run_once(arm, t, plan.reqs, concurrency=plan.concurrency, on_done=done)
            runs[arm].append(r)
            if progress is not None:  # a line per run: in a terminal above the bar, in a log file on its own
                progress.console.print(run_line(i, len(order), r), highlight=False, soft_wrap=True)
        finally:
            if side:
                side.stop()
            if plan.after_run:
                plan.after_run(arm, i)
    base = runs.get("baseline") or None
    arms = {a: summarize(rs, base if a != "baseline" else None) for a, rs in runs.items()}
    return {"arms": arms, "order": order, "requests_per_run": len(plan.reqs)}


def run_line(i: int, n_runs: int, r: RunResult) -> str:
    """One finished run in one line (run ``i`` of ``n_runs``, 0-based): what a long bench logs as it goes, so
    that a bench under ``nohup`` (no terminal: the progress bar draws nothing) still shows where it is."""
    ttft = statistics.fmean(r.ttft_s) if r.ttft_s else math.nan
    c = r.counters
    return (
        f"run {i + 1}/{n_runs} {r.arm}: {len(r.ttft_s)} requests ({r.failed} failed) in {r.wall_s:.0f} s,"
        f" TTFT mean {ttft:.3f} s, hit tokens {c.get('hit_tokens_total', 0):.0f}"
        f" (L1 {c.get('l1_hit_tokens', 0):.0f}, L2 {c.get('l2_hit_tokens', 0):.0f})"
    )


def to_json(result: dict[str, Any]) -> str:
    """JSON with NaN as null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(result), indent=2)


POOLED_FIELDS = ("l1_hit_tokens", "l2_hit_tokens", "hit_tokens_total", "recomputed_tokens", "ttft_mean_s")


def pool_series(
    docs: Sequence[dict[str, Any]], arm: str, *, n_boot: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """Pool several bench JSONs (``--json`` of separate invocations on the same setup) into one comparison of
    ``arm`` against ``baseline``, per field of :data:`POOLED_FIELDS`: each series' own ratio (its arm's
    per-run mean over its baseline's), the pooled ratio, and a 95 % CI. One series of 3 runs per arm swings
    by several points; a claim judged on one favourable series of several is a selected one, so the pooled
    figure is the one to judge.

    Each series is a block: its arms ran interleaved in the same minutes, but separate invocations may run
    on hosts whose speed differs by tens of percent. So the pooled ratio is the geometric mean of the
    series' ratios weighted by their runs of ``arm`` (never a ratio of raw means across series, which would
    weigh slow hours more and let the spread between hosts widen the interval), and its CI is a stratified
    percentile bootstrap: runs are resampled within each series and arm, every replicate recomputes every
    series' ratio; the interval is widened about the pooled ratio for the numbers of runs
    (:func:`small_sample_factor` over every series' arm and baseline). The TTFT ratio here is run-level
    (each run's mean TTFT), coarser than a single invocation's two-stage bootstrap; series written before
    ``per_run`` held ``ttft_mean_s`` are left out of that field only (``series_used`` says how many
    counted)."""
    out: dict[str, Any] = {"arm": arm, "series": len(docs), "fields": {}}
    rng = np.random.default_rng(seed)
    for f in POOLED_FIELDS:
        blocks: list[tuple[np.ndarray, np.ndarray]] = []
        for d in docs:
            arms = d.get("arms", {})
            ra = (arms.get(arm) or {}).get("per_run", {}).get(f)
            rb = (arms.get("baseline") or {}).get("per_run", {}).get(f)
            if not ra or not rb or any(v is None for v in (*ra, *rb)):
                continue
            blocks.append((np.asarray(ra, dtype=float), np.asarray(rb, dtype=float)))
        each = [_ratio(a, b) for a, b in blocks]
        weights = np.asarray([a.size for a, _ in blocks], dtype=float)
        pooled = _weighted_geomean(each, weights) if blocks else math.nan
        ci: tuple[float, float] = (math.nan, math.nan)
        if blocks:
            reps = np.empty(n_boot)
            for i in range(n_boot):
                reps[i] = _weighted_geomean(
                    [_ratio(a[rng.integers(0, a.size, a.size)], b[rng.integers(0, b.size, b.size)])
                     for a, b in blocks],
                    weights,
                )  # fmt: skip
            sizes = [n for a, b in blocks for n in (a.size, b.size)]
            ci = widen(_percentiles(reps, 0.05), pooled, small_sample_factor(*sizes), log=True)
        out["fields"][f] = {
            "ratio": pooled,
            "ci95": ci,
            "runs": (int(sum(a.size for a, _ in blocks)), int(sum(b.size for _, b in blocks))),
            "series_used": len(blocks),
            "per_series": each,
        }
    return out


def _weighted_geomean(ratios: Sequence[float], weights: np.ndarray) -> float:
    """exp of the weighted mean of log ratios; nan if any ratio is not a positive number."""
    r = np.asarray(ratios, dtype=float)
    if r.size == 0 or not np.all(np.isfinite(r)) or np.any(r <= 0):
        return math.nan
    return float(np.exp(np.sum(weights * np.log(r)) / np.sum(weights)))
