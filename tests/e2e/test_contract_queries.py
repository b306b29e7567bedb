"""The kvtier panels' PromQL against a REAL Prometheus scraping the REAL sidecar's ``/metrics``.

``kvtier demo`` (a subprocess) is the sidecar -- collectors, reconcile loop, learned predictor, tier view --
over the bundled trace on emulated tiers (plus a tier path for the storage collector), so it needs no vLLM or
LMCache. Every kvtier-only panel query (and template-variable query) of every dashboard must return a non-NaN
series: this proves the expressions (``ignoring(tier) group_left``, ratios, histogram quantiles) against what
the sidecar really exports, label values included. The families only a live engine moves are listed in
:data:`NEEDS_A_LIVE_PEER` with the reason; their panels are evaluated by ``test_dashboard_queries.py``
(``kvtier serve`` watching a real vLLM and LMCache), and must stay empty here so the list cannot go stale.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvtier.dashboards import lint
from tests.e2e import prom as promlib
from tests.e2e.demo_proc import running_demo
from tests.e2e.device_reads import read_until_the_collector_saw_reads
from tests.peers.procs import wait_for

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

# Families the demo's sidecar registers but cannot move without a live peer (each with the reason). A query
# reading one is evaluated by test_dashboard_queries.py against real vLLM + LMCache instead.
NEEDS_A_LIVE_PEER: dict[str, str] = {
    "kvtier_kv_events_total": "vLLM's ZMQ KV-event stream; the demo replays a trace, no engine publishes",
    "kvtier_kv_events_lost_total": "sequence gaps of vLLM's KV-event stream (same reason)",
}


def _reads(expr: str, families: dict[str, str]) -> set[str]:
    return {f for f in families if f in expr}


def test_kvtier_panel_queries_return_series_from_the_real_sidecar(tmp_path: Path) -> None:
    queries = [q for q in lint.queries(lint.load()) if q.sources == {"kvtier"}]
    assert len(queries) > 30
    paths = json.dumps({"disk": str(tmp_path)})  # the storage collector's tier path (the path-usage panel)
    with (
        running_demo("--speed", "30", "--duration", "600", env={"KVTIER_TIER_PATHS": paths}) as demo,
        promlib.running({"kvtier": [demo.target]}) as prom,
    ):
        # every rate() below reads a [1m] window: wait for successful scrapes inside that window (on a loaded
        # machine timed-out scrapes spread them out, and a rate needs two points in its window)
        prom.wait_scraped({"kvtier"}, samples=4, window="1m", timeout_s=180)
        # the predictor panels show a trained model's figures: wait for the first training
        wait_for(lambda: demo.get("/v1/model").json().get("auc") is not None, 180, "demo model trained")
        prom.wait_until("count(kvtier_predictor_auc)", lambda v: v >= 1, timeout_s=120)

        read_until_the_collector_saw_reads(prom, tmp_path)  # the read-latency panel needs device reads
        at = time.time()
        bad, pending_with_data = [], []
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
            live_only = _reads(expr, NEEDS_A_LIVE_PEER)
            if live_only and n:
                pending_with_data.append(str(q))
            elif not live_only and not n:
                bad.append(str(q))
        assert not bad, f"kvtier queries with no (non-NaN) series from the real sidecar: {bad}"
        assert not pending_with_data, f"data from the demo: drop from NEEDS_A_LIVE_PEER: {pending_with_data}"
