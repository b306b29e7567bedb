"""kvtier's Mooncake actuator + collector against a REAL Mooncake master with two TCP clients, in a private
network namespace (``unshare -n``; the scenario runs inside it: tests/peers/scripts/mooncake_scenario.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.peers.mooncake import run_in_netns

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("mooncake")
    out = run_in_netns("mooncake_scenario.py", work, timeout_s=240)
    print("\nMOONCAKE_RESULT " + json.dumps(out)[:6000])
    return out


def outcomes(r: dict[str, Any]) -> list[str]:
    return [o[1] for o in r["outcomes"]]


def test_collector_reads_the_masters_metrics_and_summary(run: dict[str, Any]) -> None:
    assert run["m0"]["families"] >= 130
    assert run["m0"]["active_clients"] == 2 and run["m0"]["summary"] == {"role": "leader", "clients": 2}
    m1 = run["m1"]
    assert m1["rpc"]["create_copy_task"] >= 1 and m1["rpc"]["create_move_task"] >= 1
    assert m1["rpc"]["put_start"] >= 4 and m1["rpc"]["remove"] >= 2
    assert "master_evicted_key_count" in m1["eviction_keys"] and m1["promotion_n"] > 5
    assert m1["cap_cpu"] == 2 * (64 << 20)
    assert set(run["segments"]) <= set(m1["segments"])


def test_copy_reaches_the_master_and_adds_a_replica(run: dict[str, Any]) -> None:
    a, b = run["segments"]
    assert run["seg_k1_before"] == [a]
    assert outcomes(run["copy_k1"]) == ["applied"]
    assert sorted(run["seg_k1_after"]) == sorted([a, b])
    assert outcomes(run["copy_k1_again"]) == ["skipped"]  # idempotent


def test_move_reaches_the_master_and_relocates_the_replica(run: dict[str, Any]) -> None:
    a, b = run["segments"]
    assert run["seg_k2_before"] == [b]
    assert outcomes(run["move_k2"]) == ["applied"]
    assert run["seg_k2_after"] == [a]
    assert outcomes(run["move_k2_again"]) == ["skipped"]


def test_soft_pin_and_unpin_reach_the_master(run: dict[str, Any]) -> None:
    a, _ = run["segments"]
    assert outcomes(run["pin_k4"]) == ["applied"]
    before, after = run["soft_pins"]
    assert after == before + 1
    assert run["seg_k4_after_pin"] == [a] and run["k4_bytes_kept"] is True
    assert outcomes(run["unpin_k4"]) == ["applied"]
    assert float(run["soft_pins_after_unpin"]) == before
    assert outcomes(run["pin_missing"]) == ["failed"] and "not found" in run["pin_missing"]["outcomes"][0][2]


def test_hard_pin_at_write_lookup_and_evict_outcomes(run: dict[str, Any]) -> None:
    assert outcomes(run["write_k3_hard"]) == ["applied"]
    lk = {o[0]: o for o in run["lookup"]["outcomes"]}
    assert lk["k1"][1] == "applied" and lk["nope"][1] == "skipped"
    assert outcomes(run["evict_missing"]) == ["skipped"]
    first = run["evict_k2_in_lease"]["outcomes"][0]  # read just before: the 2 s read lease blocks removal
    assert first[1] == "failed" and "lease" in first[2]
    assert outcomes(run["evict_k2_after_lease"]) == ["applied"]
    assert outcomes(run["evict_k3_hard"]) == ["applied"]
    assert run["exists_after"]["k2"] == 0 and run["exists_after"]["k3"] == 0


def test_unreachable_master_fails_per_key_and_opens_the_breaker(run: dict[str, Any]) -> None:
    assert outcomes(run["dead_1"]) == ["failed"] and "unreachable" in run["dead_1"]["outcomes"][0][2]
    assert outcomes(run["dead_2"]) == ["failed"] and "circuit open" in run["dead_2"]["outcomes"][0][2]
    assert run["dead_health"] == "open"
