"""Schemathesis over the control API's OpenAPI spec (bounded examples): no 5xx for any generated input."""

from __future__ import annotations

from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from kvtier.controller.runtime import build_control_plane, create_control_app
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier


def _app() -> object:
    import tempfile

    idx = BlockIndex()
    for h in range(1, 60):
        idx.store(h, None, Tier.GPU, t=1000.0 * h)
    reg = CollectorRegistry()
    plane = build_control_plane(idx, registry=reg, state_dir=Path(tempfile.mkdtemp(prefix="kvtier-fuzz-")))
    plane.loop.tick()
    return create_control_app(plane, reg)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, (
        f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    )
