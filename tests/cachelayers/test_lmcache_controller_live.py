"""kvtier's LMCache-controller actuator + collector against a REAL ``lmcache_controller`` with a REAL CPU-only
standalone LMCache worker, in a private network namespace (the worker binds all interfaces); the scenario
runs inside it: tests/peers/scripts/lmcache_controller_scenario.py. KV chunks are put into the worker
through its own internal API (``/cache/store?tokens_mock=``).

The sidecar part runs ``kvtier serve --lmcache-controller-url`` against another such controller + worker;
its driver is this module run as a script inside the namespace (the sidecar must live where it can reach the
controller): ``python tests/cachelayers/test_lmcache_controller_live.py --workdir W``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.peers.lmcache_controller import ControllerCluster, run_in_netns
from tests.peers.procs import free_port, start, stop, wait_for
from tests.peers.sidecar_probe import cache_layer, down_report

pytestmark = pytest.mark.lmcache


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("lmcache_controller")
    out = run_in_netns("lmcache_controller_scenario.py", work, timeout_s=400)
    print("\nLMCACHE_CONTROLLER_RESULT " + json.dumps(out)[:6000])
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("lmcache_controller_serve")
    # an absolute script path replaces tests/peers/scripts/ in the namespace runner's path join
    out = run_in_netns(str(Path(__file__).resolve()), work, timeout_s=400)
    print("\nLMCACHE_CONTROLLER_SERVE_RESULT " + json.dumps(out)[:6000])
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


def test_serve_shows_the_controllers_workers_and_key_counts(served: dict[str, Any]) -> None:
    """``kvtier serve --lmcache-controller-url``: /v1/status cache_layers = the controller's own API."""
    empty, stored = served["empty"], served["stored"]
    assert served["kind"] == "lmcache_controller" and served["url"] == served["controller_url"]
    assert empty["sidecar"] == empty["controller"]
    assert empty["controller"]["worker_count"] == 1 and empty["controller"]["total_key_count"] == 0
    assert empty["controller"]["keys_by_instance"] == {"standalone0": 0}
    assert served["store"]["status"] == 200
    assert stored["sidecar"] == stored["controller"]
    c = stored["controller"]
    assert c["total_key_count"] == 2 and c["keys_by_instance"] == {"standalone0": 2}  # 512 tokens = 2 chunks
    assert c["worker_count"] == 1 and c["instance_count"] == 1 and len(c["workers"]) == 1
    assert c["workers"][0][:2] == ["standalone0", 0]


def test_serve_builds_the_controller_actuator_from_the_controller_url(served: dict[str, Any]) -> None:
    """``--actuator lmcache-controller`` needs no URL option: it uses ``--lmcache-controller-url``."""
    acts = {a["name"]: a for a in served["actuators"]}
    assert "lmcache-controller" in acts and acts["lmcache-controller"]["health"]["breaker"] == "closed"
    assert {"pin", "lookup", "clear", "move"} <= set(acts["lmcache-controller"]["capabilities"])


def test_serve_readyz_names_the_down_controller_and_counts_errors(served: dict[str, Any]) -> None:
    assert served["up_before_stop"] is True
    assert served["down"] == [served["name"]] and served["storage_up"] is True
    assert served["errors_total"] >= 1 and served["fetch_errors"] >= 1


# ---- driver, run inside the network namespace ------------------------------------------------------------
def _own_view(url: str) -> dict[str, Any]:
    """The controller's own API, reduced to the figures kvtier's collector reports."""
    ks = httpx.get(url + "/controller/key-stats", timeout=5).json()
    ws = httpx.get(url + "/controller/workers", timeout=5).json().get("workers") or []
    return {
        "total_key_count": ks["total_key_count"],
        "instance_count": ks.get("total_instance_count"),
        "worker_count": ks.get("total_worker_count"),
        "keys_by_instance": {str(i["instance_id"]): i["key_count"] for i in ks.get("instances") or []},
        "workers": sorted([w["instance_id"], w["worker_id"], w["ip"], w["port"], w["key_count"]] for w in ws),
    }


def _sidecar_view(sidecar: str, name: str) -> dict[str, Any]:
    lt = cache_layer(sidecar, name)["latest"]
    return {k: lt[k] for k in ("total_key_count", "instance_count", "worker_count", "keys_by_instance")} | {
        "workers": sorted(
            [w["instance_id"], w["worker_id"], w["ip"], w["port"], w["key_count"]] for w in lt["workers"]
        )
    }


def _both_when_equal(sidecar: str, name: str, url: str, keys: int) -> dict[str, Any] | None:
    """Both views once the sidecar has caught up with the controller holding ``keys`` keys."""
    own = _own_view(url)
    side = _sidecar_view(sidecar, name)
    return {"controller": own, "sidecar": side} if own["total_key_count"] == keys and side == own else None


def _serve_main(workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cl = ControllerCluster(workdir)
    serve = None
    try:
        cl.start()
        port = free_port()
        sidecar = f"http://127.0.0.1:{port}"
        name = f"lmcache_controller:127.0.0.1:{cl.http_port}"
        log = workdir / "serve.log"
        # the actuator takes its URL from --lmcache-controller-url too (only the worker id is an option)
        serve = start(
            [
                sys.executable,
                "-m",
                "kvtier",
                "serve",
                "--lmcache-controller-url",
                cl.url,
                "--actuator",
                "lmcache-controller",
                "--listen",
                f"127.0.0.1:{port}",
                "--state-dir",
                str(workdir / "state"),
            ],
            log,
            env={
                "KVTIER_SCRAPE_INTERVAL_S": "0.3",
                "KVTIER_STORAGE_INTERVAL_S": "0.3",
                "KVTIER_ACTUATOR_OPTIONS": json.dumps({"lmcache-controller": {"instance_id": "standalone0"}}),
            },
            new_session=False,
        )
        out["empty"] = wait_for(
            lambda: _both_when_equal(sidecar, name, cl.url, 0),
            60,
            "sidecar shows the empty controller",
            proc=serve,
            log=log,
        )
        layer = cache_layer(sidecar, name)
        out.update(name=name, kind=layer["kind"], url=layer["url"], controller_url=cl.url)
        out["actuators"] = httpx.get(sidecar + "/v1/status", timeout=5).json()["controller"]["actuators"]
        out["store"] = cl.store(0, cl.chunk_size * 2)
        out["stored"] = wait_for(
            lambda: _both_when_equal(sidecar, name, cl.url, 2),
            30,
            "sidecar shows the stored chunks",
            proc=serve,
            log=log,
        )
        out["up_before_stop"] = httpx.get(sidecar + "/readyz", timeout=5).json()["peers_up"]
        cl.stop()
        out.update(down_report(sidecar, name, "controller", serve, log))
    finally:
        stop(serve)
        cl.stop()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    print("RESULT " + json.dumps(_serve_main(Path(ap.parse_args().workdir)), default=str), flush=True)
