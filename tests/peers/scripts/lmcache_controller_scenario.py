"""Runs INSIDE a private network namespace (tests.peers.lmcache_controller.run_in_netns): starts a real
lmcache_controller + standalone CPU worker, stores mock-token KV into the worker, then drives kvtier's
LMCacheControllerActuator and LMCacheControllerCollector; prints ``RESULT {json}``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from kvtier.collectors.lmcache_controller import LMCacheControllerCollector
from kvtier.controller.actuators.base import ActuationResult, BlockRef, Location
from kvtier.controller.actuators.lmcache_controller import build
from kvtier.policies.tiers import Tier
from tests.peers.lmcache_controller import ControllerCluster
from tests.peers.procs import wait_for


def res(r: ActuationResult) -> dict[str, Any]:
    return {
        "action": r.action,
        "attempts": r.attempts,
        "outcomes": [[o.key, o.outcome.value, o.detail] for o in r.outcomes],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    out: dict[str, Any] = {}
    cl = ControllerCluster(Path(a.workdir))
    try:
        cl.start()
        loop = asyncio.new_event_loop()
        coll = LMCacheControllerCollector(
            "lmcache_controller:test", cl.url, client=httpx.AsyncClient(), registry=CollectorRegistry()
        )

        def sample() -> Any:
            s = loop.run_until_complete(coll.poll())
            assert s is not None, coll.health
            return s

        s0 = sample()
        out["s0"] = {
            "keys": s0.total_key_count,
            "workers": s0.worker_count,
            "instances": s0.keys_by_instance,
            "worker_ports": [w.port for w in s0.workers],
        }
        n = cl.chunk_size * 2
        out["store"] = cl.store(0, n)
        out["keys_after_store"] = wait_for(
            lambda: sample().total_key_count or None, 30, "admit messages reach the controller"
        )
        act = build(cl.url, cl.instance_id)
        cached = BlockRef(model="tiny", token_ids=tuple(range(n)))
        absent = BlockRef(model="tiny", token_ids=tuple(range(10_000, 10_000 + n)))
        out["capabilities"] = sorted(c.value for c in act.capabilities())
        out["lookup"] = res(act.lookup([cached, absent]))
        out["pin"] = res(act.pin([cached, absent], Tier.CPU, ttl_s=30))
        out["move"] = res(
            act.move([cached], Location(Tier.DISK, cl.instance_id), Location(Tier.CPU, cl.instance_id))
        )
        out["no_tokens"] = res(act.pin([BlockRef(layer_key="abc")], Tier.CPU))
        other = BlockRef(model="tiny", token_ids=tuple(range(n, 2 * n)))
        out["store_other"] = cl.store(n, 2 * n)
        out["keys_before_clear"] = wait_for(
            lambda: (c := sample().total_key_count) >= 4 and c, 30, "second store reaches the controller"
        )
        out["lookup_other"] = res(act.lookup([other]))
        out["clear"] = res(act.clear(Location(Tier.CPU, cl.instance_id)))
        counts: list[int] = []

        def cleared() -> bool:
            counts.append(sample().total_key_count)
            return counts[-1] <= 2

        with contextlib.suppress(TimeoutError):
            wait_for(cleared, 20, "evict messages reach the controller", interval_s=0.5)
        out["keys_after_clear"] = counts[-1]
        out["lookup_after_clear"] = res(act.lookup([cached, other]))
        out["health"] = act.health().breaker
        s1 = sample()
        out["s1"] = {
            "keys": s1.total_key_count,
            "workers": s1.worker_count,
            "heartbeat_age_s": [w.heartbeat_age_s for w in s1.workers],
        }
    finally:
        cl.stop()
    # with the controller gone: transport errors, retries, then the breaker opens
    dead = build(cl.url, cl.instance_id, timeout_s=1.0)
    out["dead"] = [res(dead.lookup([BlockRef(token_ids=(1, 2, 3))])) for _ in range(2)]
    out["dead_health"] = dead.health().breaker
    print("RESULT " + json.dumps(out, default=str), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
