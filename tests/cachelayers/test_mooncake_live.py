"""kvtier's Mooncake actuator + collector against a REAL Mooncake master with two TCP clients, in a private
network namespace (``unshare -n``; the scenario runs inside it: tests/peers/scripts/mooncake_scenario.py).

The sidecar part runs ``kvtier serve --mooncake-url`` against another such master; its driver is this module
run as a script inside the namespace (the sidecar must live where it can reach the master):
``python tests/cachelayers/test_mooncake_live.py --workdir W --kvtier-python PY``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.peers.mooncake import MooncakeCluster, run_in_netns
from tests.peers.procs import free_port, start, stop, wait_for
from tests.peers.sidecar_probe import cache_layer, down_report

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("mooncake")
    out = run_in_netns("mooncake_scenario.py", work, timeout_s=240)
    print("\nMOONCAKE_RESULT " + json.dumps(out)[:6000])
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("mooncake_serve")
    # an absolute script path replaces tests/peers/scripts/ in the namespace runner's path join; the driver
    # runs under the Mooncake venv, `kvtier serve` under this one
    out = run_in_netns(str(Path(__file__).resolve()), work, "--kvtier-python", sys.executable, timeout_s=300)
    print("\nMOONCAKE_SERVE_RESULT " + json.dumps(out)[:6000])
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


def test_serve_shows_the_masters_figures(served: dict[str, Any]) -> None:
    """``kvtier serve --mooncake-url``: /v1/status cache_layers = the master's own /metrics and summary."""
    assert served["kind"] == "mooncake" and served["url"] == served["master_url"]
    assert served["put_rc"] == [0, 0, 0]
    assert served["view"]["sidecar"] == served["view"]["master"]
    m = served["view"]["master"]
    assert m["key_count"] == 3 and m["active_clients"] == 2 and m["capacity_cpu"] == 2 * (64 << 20)
    assert m["allocated_cpu"] >= 3 * 4096 and m["summary"] == {"role": "leader", "keys": 3, "clients": 2}
    assert served["families"] >= 130


def test_serve_readyz_names_the_down_master_and_counts_errors(served: dict[str, Any]) -> None:
    assert served["up_before_stop"] is True
    assert served["down"] == [served["name"]] and served["storage_up"] is True
    assert served["errors_total"] >= 1 and served["fetch_errors"] >= 1


# ---- driver, run inside the network namespace ------------------------------------------------------------
def _master_view(url: str) -> dict[str, Any]:
    """The master's own /metrics (summed by sample name) and /metrics/summary, reduced to kvtier's figures."""
    sums: dict[str, float] = {}
    for ln in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if ln and not ln.startswith("#"):
            name, value = re.split(r"[{ ]", ln, maxsplit=1)[0], ln.rsplit(None, 1)[-1]
            sums[name] = sums.get(name, 0.0) + float(value)
    summary = httpx.get(url + "/metrics/summary", timeout=5).text
    grab = lambda pat: (m := re.search(pat, summary)) and m.group(1)  # noqa: E731
    return {
        "key_count": sums["master_key_count"],
        "active_clients": sums["master_active_clients"],
        "capacity_cpu": sums["master_total_capacity_bytes"],
        "allocated_cpu": sums["master_allocated_bytes"],
        "summary": {
            "role": grab(r"role=(\w+)"),
            "keys": int(grab(r"Keys: (\d+)") or -1),
            "clients": int(grab(r"Clients: (\d+)") or -1),
        },
    }


def _sidecar_view(sidecar: str, name: str) -> dict[str, Any]:
    lt = cache_layer(sidecar, name)["latest"]
    sm = lt["summary"] or {}
    return {
        "key_count": lt["key_count"],
        "active_clients": lt["active_clients"],
        "capacity_cpu": lt["capacity_bytes"]["cpu"],
        "allocated_cpu": lt["allocated_bytes"]["cpu"],
        "summary": {k: sm.get(k) for k in ("role", "keys", "clients")},
    }


def _both_when_equal(sidecar: str, name: str, url: str, keys: int) -> dict[str, Any] | None:
    own = _master_view(url)
    side = _sidecar_view(sidecar, name)
    return {"master": own, "sidecar": side} if own["key_count"] == keys and side == own else None


def _serve_main(workdir: Path, kvtier_python: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cl = MooncakeCluster(workdir)
    serve = store = None
    try:
        cl.start()
        store = cl.client(f"127.0.0.1:{free_port()}")
        port = free_port()
        sidecar = f"http://127.0.0.1:{port}"
        name = f"mooncake:127.0.0.1:{cl.metrics_port}"
        log = workdir / "serve.log"
        serve = start([kvtier_python, "-m", "kvtier", "serve", "--mooncake-url", cl.admin_url,
                       "--listen", f"127.0.0.1:{port}", "--state-dir", str(workdir / "state")], log,
                      env={"KVTIER_SCRAPE_INTERVAL_S": "0.3", "KVTIER_STORAGE_INTERVAL_S": "0.3",
                           "LD_LIBRARY_PATH": ""}, new_session=False)  # fmt: skip
        out["put_rc"] = [store.put(f"serve-k{i}", os.urandom(4096)) for i in range(3)]
        out["view"] = wait_for(lambda: _both_when_equal(sidecar, name, cl.admin_url, 3), 60,
                               "sidecar shows the master's keys", proc=serve, log=log)  # fmt: skip
        layer = cache_layer(sidecar, name)
        out.update(name=name, kind=layer["kind"], url=layer["url"], master_url=cl.admin_url,
                   families=layer["latest"]["families"])  # fmt: skip
        out["up_before_stop"] = httpx.get(sidecar + "/readyz", timeout=5).json()["peers_up"]
        store.close()
        store = None
        cl.stop()
        out.update(down_report(sidecar, name, "master", serve, log))
    finally:
        stop(serve)
        if store is not None:
            store.close()
        cl.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--kvtier-python", required=True)
    a = ap.parse_args()
    print("RESULT " + json.dumps(_serve_main(Path(a.workdir), a.kvtier_python), default=str), flush=True)
    os._exit(0)  # the Mooncake client's threads may outlive close()
