"""kvtier's windowed latency quantiles equal a REAL Prometheus' ``histogram_quantile`` over two texts.

A loopback HTTP server serves vLLM-shaped exposition text A (two DP engines, two models), then text B (more
observations). Debian's ``prometheus`` scrapes it every second; ``VllmMetricsCollector.poll()`` reads the same
server. How the comparison is made exact:

* ``increase()``/``rate()`` extrapolate to the window's edges, and the extrapolation is clamped per series
  (the zero point of each bucket counter differs), so they can differ from the raw bucket deltas.
* ``idelta(v[1m])`` is the difference of the LAST TWO samples in the window, without extrapolation. Evaluated
  at the timestamp of Prometheus' first B sample (read back from the TSDB with a range query), those two
  samples are the last A scrape and the first B scrape, so it is exactly B - A per bucket, the same delta
  kvtier uses. Evaluated at the second A sample it is a window with no new observations (NaN <-> None).

Nothing is faked: real HTTP server, real Prometheus, real collector.
"""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.collectors.vllm_metrics import EngineSample, VllmMetricsCollector
from tests.collectors.vllm_text import HIST, EngineState, render
from tests.e2e import prom as promlib
from tests.peers.http_server import MetricsText, metrics_text_handler, serving
from tests.peers.procs import wait_for

pytestmark = pytest.mark.prometheus

QS = (0.5, 0.9, 0.99)
KEYS = (("llama", "0"), ("llama", "1"), ("qwen", "0"))


def _states() -> tuple[list[EngineState], list[EngineState]]:
    rng = random.Random(11)
    a, b = [], []
    for i, (model, engine) in enumerate(KEYS):
        e = EngineState(
            model=model,
            engine=engine,
            prompt=100.0 * (i + 1),
            ttft=tuple(rng.lognormvariate(-2.5, 1.0) for _ in range(20 + i)),
            itl=tuple(rng.lognormvariate(-4.0, 0.8) for _ in range(200)),
            e2e=tuple(rng.uniform(0.2, 30.0) for _ in range(20 + i)),
        )
        a.append(e)
        b.append(
            e.then(
                prompt=e.prompt + 500.0,
                ttft=tuple(rng.lognormvariate(-1.5 + i, 1.2) for _ in range(37 + 5 * i)),
                # a few past the last finite ITL bound: p99 lands in +Inf for engine ("llama", "1")
                itl=tuple(rng.lognormvariate(-3.0, 1.0) for _ in range(150))
                + (120.0,) * (3 if i == 1 else 0),
                e2e=tuple(rng.lognormvariate(1.0 + i, 0.7) for _ in range(30)),
            )
        )
    return a, b


def _sample_times(prom: promlib.Prometheus, engine: EngineState, family: str) -> list[tuple[float, float]]:
    sel = f'{family}_count{{model_name="{engine.model}",engine="{engine.engine}"}}[5m]'
    (series,) = prom.query(sel)
    return [(float(t), float(v)) for t, v in series["values"]]


def _prom_quantiles(prom: promlib.Prometheus, family: str, at: float) -> dict[tuple[str, str, float], float]:
    out = {}
    for q in QS:
        for r in prom.query(f"histogram_quantile({q}, idelta({family}_bucket[1m]))", at=at):
            out[(r["metric"]["model_name"], r["metric"]["engine"], q)] = float(r["value"][1])
    return out


def _assert_same(
    kv: list[EngineSample], pq: dict[tuple[str, str, float], float], hist: str, what: str
) -> None:
    assert {(s.model, s.engine) for s in kv} == set(KEYS)
    for s in kv:
        lat = getattr(s, hist)
        assert lat is not None, (what, hist, s.model, s.engine)
        for q in QS:
            mine, theirs = getattr(lat, f"p{round(q * 100)}"), pq[(s.model, s.engine, q)]
            if math.isnan(theirs):
                assert mine is None, (what, hist, s.model, s.engine, q, mine)
            else:
                assert mine == pytest.approx(theirs, rel=1e-9, abs=1e-12), (what, hist, s.model, s.engine, q)


def test_window_quantiles_equal_prometheus_histogram_quantile() -> None:
    a, b = _states()

    state = MetricsText()
    state.text = render(a)
    reg = CollectorRegistry()
    times = iter([0.0, 5.0, 10.0])

    async def poll_a_a_b(url: str) -> list[list[EngineSample]]:
        out = []
        async with httpx.AsyncClient() as client:
            c = VllmMetricsCollector(
                "vllm_metrics:p", url, client=client, registry=reg, clock=lambda: next(times)
            )
            for text in (render(a), render(a), render(b)):
                state.text = text
                obs = await c.poll()
                assert obs is not None, c.health
                out.append(list(obs.engines))
        return out

    with serving(metrics_text_handler(state)) as url, promlib.running({"vllm": [url.split("/")[2]]}) as prom:
        family = HIST["ttft"][0]
        n_a, n_b = len(a[0].ttft), len(b[0].ttft)

        def a_scraped_twice() -> list[tuple[float, float]] | None:
            pts = _sample_times(prom, a[0], family)
            return pts if len(pts) >= 2 else None

        pts_a = wait_for(a_scraped_twice, 90, "prometheus: two scrapes of text A", interval_s=0.3)
        assert all(v == n_a for _, v in pts_a)
        kv = asyncio.run(poll_a_a_b(url))  # leaves B served

        def b_scraped() -> list[tuple[float, float]] | None:
            pts = _sample_times(prom, a[0], family)
            return pts if pts[-1][1] == n_b else None

        pts = wait_for(b_scraped, 90, "prometheus: a scrape of text B", interval_s=0.3)
        i_b = next(i for i, (_, v) in enumerate(pts) if v == n_b)
        assert i_b >= 2 and all(v == n_a for _, v in pts[:i_b])  # ... A, A, B: the last two at t_b are A -> B
        t_a2, t_b = pts[1][0], pts[i_b][0]

        _, no_new, window = kv
        for hist, (fam, _, _) in HIST.items():
            _assert_same(window, _prom_quantiles(prom, fam, t_b), hist, "A -> B")
            _assert_same(no_new, _prom_quantiles(prom, fam, t_a2), hist, "A -> A (no new observations)")
        # the +Inf case really was exercised
        (l1,) = [s for s in window if (s.model, s.engine) == ("llama", "1")]
        assert l1.itl is not None and l1.itl.p99 == HIST["itl"][1][-1]
        (raw,) = prom.query(f'idelta({family}_count{{model_name="qwen"}}[1m])', at=t_b)
        assert float(raw["value"][1]) == len(b[2].ttft) - len(a[2].ttft) == kv[2][2].ttft.count  # type: ignore[union-attr]
