"""The kvtier panels' PromQL against a REAL Prometheus scraping a STAND-IN exporter of the metric contract.

The sidecar's ``/metrics`` does not exist yet (no real peer to scrape), so ``contract_exporter`` serves every
metric of ``dashboards/METRICS.md`` with synthetic, moving values. This proves the expressions (label matching
such as ``ignoring(tier) group_left``, ratios, histogram quantiles, variable queries) return series when the
contract is met. The real check is ``test_dashboard_queries.py`` with ``kvtier`` in its ``SCRAPED``.
"""

from __future__ import annotations

import time

import pytest

from kvtier.dashboards import lint
from tests.e2e import prom as promlib
from tests.e2e.contract_exporter import contract, serving

pytestmark = pytest.mark.prometheus


def test_contract_parses() -> None:
    specs = {s.name: s for s in contract()}
    assert specs["kvtier_kv_events_total"].labels["type"] == (
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    )
    assert specs["kvtier_loop_tick_seconds"].kind == "histogram"
    assert specs["kvtier_blocks_tracked"].labels == {"tier": ("gpu", "cpu", "disk", "remote")}
    assert specs["kvtier_lookup_tokens_total"].labels == {}


def test_kvtier_panel_queries_return_series_when_the_contract_is_met() -> None:
    queries = [q for q in lint.queries(lint.load()) if q.sources == {"kvtier"}]
    assert len(queries) > 30
    with serving() as port, promlib.running({"kvtier": [f"127.0.0.1:{port}"]}) as prom:
        # every rate() below reads a [1m] window: wait for successful scrapes inside that window (on a
        # loaded machine timed-out scrapes spread them out, and a rate needs two points in its window)
        prom.wait_scraped({"kvtier"}, samples=4, window="1m", timeout_s=120)
        # and for every series of the contract itself to hold two points there: the stand-in creates its
        # labelled children in its first step, which a loaded machine can delay past the first scrapes
        for s in contract():
            name = f"{s.name}_count" if s.kind == "histogram" else s.name
            prom.wait_until(f"min(count_over_time({name}[1m]))", lambda v: v >= 2, timeout_s=120)
        at = time.time()
        bad = []
        for q in queries:
            expr = q.resolved({"__rate_interval": "1m"})
            if q.is_variable:
                lv = lint.label_values(expr)
                assert lv is not None and lv[0] is not None, expr
                n = len({s[lv[1]] for s in prom.series(lv[0]) if lv[1] in s})
            else:
                vec = prom.query(expr, at=at)
                n = len([v for v in vec if v["value"][1] != "NaN"])
            print(f"{n:3d} series  {q}")
            if not n:
                bad.append(str(q))
        assert not bad, f"kvtier queries with no (non-NaN) series against the contract: {bad}"
