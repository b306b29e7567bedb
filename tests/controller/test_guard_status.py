"""The L1 keeper's guard families reach the status page's history (absent without the keeper)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvtier.controller.l1_keeper import GuardMetrics
from kvtier.controller.status_page import History


def test_history_reports_the_guard_only_when_the_keeper_runs() -> None:
    r = CollectorRegistry()
    assert History(r, clock=lambda: 1.0).sample()["guard"] is None
    g = GuardMetrics(r)
    g.acting.set(0)
    g.trips.inc()
    s = History(r, clock=lambda: 2.0).sample()
    assert s["guard"] == {"acting": 0.0, "trips": 1.0, "resumes": 0.0}
