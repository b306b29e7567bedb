"""Runs INSIDE a private network namespace (via tests.peers.mooncake.run_in_netns): starts a real Mooncake
master + hold client, drives kvtier's MooncakeActuator and MooncakeCollector against them, prints
``RESULT {json}`` for the pytest test to assert on. This process is the first TCP client (segment A)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import mooncake.store as ms
from prometheus_client import CollectorRegistry

from kvtier.collectors.mooncake import MooncakeCollector
from kvtier.controller.actuators.base import ActuationResult, BlockRef, Location
from kvtier.controller.actuators.mooncake import MooncakeActuator
from kvtier.controller.actuators.resilience import CircuitBreaker, HttpCaller, Resilient, RetryPolicy
from kvtier.policies.tiers import Tier
from tests.peers.mooncake import MooncakeCluster
from tests.peers.procs import free_port, wait_for


def res(r: ActuationResult) -> dict[str, Any]:
    return {
        "action": r.action,
        "attempts": r.attempts,
        "elapsed_s": round(r.elapsed_s, 3),
        "outcomes": [[o.key, o.outcome.value, o.detail] for o in r.outcomes],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    out: dict[str, Any] = {}
    cl = MooncakeCluster(Path(a.workdir))
    try:
        cl.start()
        seg_a = f"127.0.0.1:{free_port()}"
        seg_b = cl.hold_segment
        store = cl.client(seg_a)
        act = MooncakeActuator(store, HttpCaller(cl.admin_url), bindings=ms, task_timeout_s=20)
        loop = asyncio.new_event_loop()
        coll = MooncakeCollector(
            "mooncake:test", cl.admin_url, client=httpx.AsyncClient(), registry=CollectorRegistry()
        )

        def sample() -> Any:
            s = loop.run_until_complete(coll.poll())
            assert s is not None, coll.health
            return s

        out["segments"] = [seg_a, seg_b]
        out["capabilities"] = sorted(c.value for c in act.capabilities())
        m0 = sample()
        out["m0"] = {
            "families": m0.families,
            "key_count": m0.key_count,
            "active_clients": m0.active_clients,
            "summary": m0.summary and {"role": m0.summary.role, "clients": m0.summary.clients},
        }
        out["write_k1"] = res(act.write("k1", os.urandom(1 << 20), segment=seg_a))
        out["write_k2"] = res(act.write("k2", os.urandom(4096), segment=seg_b))
        out["write_k3_hard"] = res(act.write("k3", os.urandom(4096), hard_pin=True, segment=seg_a))
        out["write_k4"] = res(act.write("k4", os.urandom(4096), segment=seg_a))
        k = lambda key: [BlockRef(layer_key=key)]  # noqa: E731
        out["seg_k1_before"] = act.segments("k1")
        out["copy_k1"] = res(act.copy(k("k1"), Location(Tier.CPU, seg_b)))
        out["seg_k1_after"] = act.segments("k1")
        out["copy_k1_again"] = res(act.copy(k("k1"), Location(Tier.CPU, seg_b)))
        out["seg_k2_before"] = act.segments("k2")
        out["move_k2"] = res(act.move(k("k2"), Location(Tier.CPU, seg_b), Location(Tier.CPU, seg_a)))
        out["seg_k2_after"] = act.segments("k2")
        out["move_k2_again"] = res(act.move(k("k2"), Location(Tier.CPU, seg_b), Location(Tier.CPU, seg_a)))
        v4 = store.get("k4")
        p0 = sample().soft_pin_key_count
        out["pin_k4"] = res(act.pin(k("k4"), Tier.CPU, ttl_s=60))
        out["soft_pins"] = [
            p0,
            wait_for(
                lambda: (v := sample().soft_pin_key_count) > p0 and v,
                15,
                "soft pin visible in master_soft_pin_key_count",
            ),
        ]
        out["seg_k4_after_pin"] = act.segments("k4")
        out["k4_bytes_kept"] = store.get("k4") == v4
        out["unpin_k4"] = res(act.unpin(k("k4"), Tier.CPU))
        out["soft_pins_after_unpin"] = wait_for(
            lambda: (v := sample().soft_pin_key_count) <= p0 and str(v), 15, "unpin visible"
        )
        out["lookup"] = res(act.lookup(k("k1") + k("nope")))
        out["pin_missing"] = res(act.pin(k("nope"), Tier.CPU))
        out["evict_missing"] = res(act.evict(k("nope")))
        store.get("k2")
        out["evict_k2_in_lease"] = res(act.evict(k("k2")))
        t0 = time.monotonic()

        tries: list[ActuationResult] = []

        def evicted() -> ActuationResult | None:
            tries.append(act.evict(k("k2")))
            return tries[-1] if tries[-1].outcomes[0].outcome.value == "applied" else None

        try:
            last = wait_for(evicted, 15, "k2 removable after its lease", interval_s=0.5)
        except TimeoutError:
            last = tries[-1]
        out["evict_k2_after_lease"] = res(last)
        out["evict_k2_after_lease_wait_s"] = round(time.monotonic() - t0, 2)
        out["evict_k3_hard"] = res(act.evict(k("k3"), force=True))
        out["exists_after"] = {key: store.is_exist(key) for key in ("k1", "k2", "k3", "k4")}
        m1 = sample()
        out["m1"] = {
            "families": m1.families,
            "key_count": m1.key_count,
            "active_clients": m1.active_clients,
            "rpc": {
                r: m1.rpc_requests.get(r, 0) - m0.rpc_requests.get(r, 0)
                for r in (
                    "create_copy_task",
                    "create_move_task",
                    "query_task",
                    "remove",
                    "put_start",
                    "copy_start",
                    "move_start",
                )
            },
            "eviction_keys": sorted(m1.eviction),
            "promotion_n": len(m1.promotion),
            "alloc_cpu": m1.allocated_bytes.get("cpu"),
            "cap_cpu": m1.capacity_bytes.get("cpu"),
            "segments": sorted(m1.segments),
            "summary": m1.summary
            and {"role": m1.summary.role, "keys": m1.summary.keys, "clients": m1.summary.clients},
        }
        # an unreachable admin endpoint: outcomes fail, breaker opens, later calls fail fast
        dead = MooncakeActuator(
            store,
            HttpCaller(
                f"http://127.0.0.1:{free_port()}",
                timeout_s=1.0,
                resilient=Resilient(
                    RetryPolicy(2, 0.01, 0.02), CircuitBreaker(2, 60.0), sleep=lambda s: None
                ),
            ),
            bindings=ms,
        )
        out["dead_1"] = res(dead.lookup(k("k1")))
        out["dead_2"] = res(dead.lookup(k("k1")))
        out["dead_health"] = dead.health().breaker
        store.remove_all(True)
        store.close()
    finally:
        cl.stop()
    print("RESULT " + json.dumps(out, default=str), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
