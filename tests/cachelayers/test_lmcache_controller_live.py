"""kvtier's LMCache-controller actuator + collector against a REAL ``lmcache_controller`` with a REAL CPU-only
standalone LMCache worker, in a private network namespace (the worker binds all interfaces); the scenario
runs inside it: tests/peers/scripts/lmcache_controller_scenario.py. KV chunks are put into the worker
through its own internal API (``/cache/store?tokens_mock=``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.peers.lmcache_controller import run_in_netns

pytestmark = pytest.mark.lmcache


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("lmcache_controller")
    out = run_in_netns("lmcache_controller_scenario.py", work, timeout_s=400)
    print("\nLMCACHE_CONTROLLER_RESULT " + json.dumps(out)[:6000])
    return out


def outcomes(r: dict[str, Any]) -> list[str]:
    return [o[1] for o in r["outcomes"]]


def test_collector_sees_worker_and_key_counts(run: dict[str, Any]) -> None:
    assert run["s0"]["workers"] == 1 and run["s0"]["keys"] == 0
    assert run["s0"]["instances"] == {"standalone0": 0}
    assert run["store"]["status"] == 200
    assert run["keys_after_store"] == 2  # 512 tokens = 2 chunks of 256, admitted by the worker
    assert run["keys_before_clear"] == 4


def test_lookup_and_pin_reach_the_worker_with_per_key_outcomes(run: dict[str, Any]) -> None:
    assert outcomes(run["lookup"]) == ["applied", "skipped"]
    assert run["lookup"]["outcomes"][0][2] == "standalone0:LocalCPUBackend:512"
    assert outcomes(run["pin"]) == ["applied", "skipped"]
    assert "pinned 512 tokens" in run["pin"]["outcomes"][0][2]
    assert outcomes(run["no_tokens"]) == ["failed"]


def test_clear_drops_the_tier_but_the_pinned_prefix_survives(run: dict[str, Any]) -> None:
    assert outcomes(run["clear"]) == ["applied"] and "cleared 512 tokens" in run["clear"]["outcomes"][0][2]
    assert run["keys_after_clear"] == 2
    assert outcomes(run["lookup_after_clear"]) == ["applied", "skipped"]


def test_move_refusal_is_recorded_with_the_controllers_reason(run: dict[str, Any]) -> None:
    o = run["move"]["outcomes"][0]
    assert o[1] == "failed" and "HTTP 500" in o[2] and "P2P" in o[2]
    assert run["move"]["attempts"] == 1  # a refusal is not retried
    assert run["health"] == "closed"


def test_controller_down_fails_then_opens_the_breaker(run: dict[str, Any]) -> None:
    first, second = run["dead"]
    assert outcomes(first) == ["failed"] and "unreachable" in first["outcomes"][0][2]
    assert first["attempts"] == 3
    assert outcomes(second) == ["failed"] and "circuit open" in second["outcomes"][0][2]
    assert second["attempts"] == 0 and run["dead_health"] == "open"
