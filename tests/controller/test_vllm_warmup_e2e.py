"""Against a REAL vLLM (CPU build): in active mode with vllm-warmup, pinning a prefix via the API warms it.

The sidecar's control API runs on a real uvicorn server; the pin is tokenized by vLLM's own /tokenize; one
reconcile tick sends the warm-up; the next request with that prefix is a prefix-cache hit in vLLM's own
``vllm:prefix_cache_hits_total``, and the decision, its actuation and outcome show in /v1/decisions, /metrics
and an OTel span. Needs ``KVTIER_VLLM_PYTHON`` and ``KVTIER_TINY_MODEL`` (``. /work/peers/env.sh``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from kvtier.controller.actuators.vllm_warmup import VllmWarmupActuator, WarmupBudget
from kvtier.controller.app import create_app
from kvtier.controller.root import build_sidecar, discover_models
from kvtier.controller.sidecar import Sidecar
from kvtier.controller.tracing import make_tracer_provider
from tests.controller import built
from tests.peers import vllm as vllm_peer

pytestmark = pytest.mark.vllm
TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def vllm_counter(text: str, name: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


@pytest.fixture(scope="module")
def vllm() -> Iterator[vllm_peer.VllmServer]:
    with vllm_peer.running(
        extra_args=["--prefix-caching-hash-algo", "sha256_cbor"], num_gpu_blocks=64
    ) as srv:
        yield srv


class Served:
    """The production app around ``sc`` on uvicorn; the test ticks the loop itself (lifecycle not managed)."""

    def __init__(self, sc: Sidecar, exporter: InMemorySpanExporter) -> None:
        self.sidecar, self.plane, self.registry, self.exporter = sc, sc.plane, sc.registry, exporter
        port = vllm_peer.free_port()
        self.url = f"http://127.0.0.1:{port}"
        cfg = uvicorn.Config(
            create_app(sc, manage_lifecycle=False), host="127.0.0.1", port=port, log_level="warning"
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:  # poll the server's own readiness flag
            if time.monotonic() > deadline:
                raise TimeoutError("control API did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture()
def sidecar(vllm: vllm_peer.VllmServer, tmp_path: Path) -> Iterator[Served]:
    exporter = InMemorySpanExporter()
    act = VllmWarmupActuator(vllm.url, vllm.served_model_name, budget=WarmupBudget(4096, 4))
    settings = built.settings(tmp_path, engine_urls=[vllm.url], engine_model=vllm.served_model_name,
                              api_token=TOKEN, allow_active=True)  # fmt: skip
    sc = build_sidecar(settings, actuators=[act],
                       tracer_provider=make_tracer_provider(exporter=exporter, simple=True))  # fmt: skip
    s = Served(sc, exporter)
    try:
        yield s
    finally:
        s.stop()
        act.close()
        sc.plane.store.close()


def test_pin_warms_prefix_into_vllm_gpu_cache(vllm: vllm_peer.VllmServer, sidecar: Served) -> None:
    c = httpx.Client(base_url=sidecar.url, timeout=30)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]
    rng = random.Random(1234)
    prefix = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(60))  # never sent before
    assert c.patch("/v1/policy", json={"mode": "active"}, headers=AUTH).status_code == 200
    r = c.post("/v1/pins", json={"prompt": prefix, "tier": "gpu"}, headers=AUTH)
    assert r.status_code == 201, r.text
    pin = r.json()
    n_blocks = len(pin["block_hashes"])
    assert n_blocks >= 2 and pin["num_tokens"] == n_blocks * vllm_peer.BLOCK_SIZE

    before = vllm.metrics_text()
    rep = sidecar.plane.loop.tick()
    assert rep.outcomes["applied"] == n_blocks, rep.to_dict()  # one warm-up request covers the whole chain
    mid = vllm.metrics_text()
    hits0 = vllm_counter(mid, "vllm:prefix_cache_hits_total")
    assert (
        vllm_counter(mid, "vllm:request_success_total")
        == vllm_counter(before, "vllm:request_success_total") + 1
    )

    # the next real request with that prefix hits the warmed blocks in vLLM's own counters
    out = vllm.complete(prefix + " and then something new", max_tokens=2)
    after = vllm.metrics_text()
    gained = vllm_counter(after, "vllm:prefix_cache_hits_total") - hits0
    assert gained >= n_blocks * vllm_peer.BLOCK_SIZE, (gained, out["usage"])

    # a repeated tick does not warm again (pin in flight / satisfied)
    again = sidecar.plane.loop.tick()
    assert again.outcomes["applied"] == 0

    ds = c.get("/v1/decisions", params={"limit": 50, "tier": "gpu"}).json()["decisions"]
    admits = [d for d in ds if d["action"] == "admit"]
    assert len(admits) == n_blocks and {d["outcome"] for d in admits} == {"applied"}
    assert {d["layer"] for d in admits} == {"vllm-warmup"} and all(d["pinned"] for d in admits)
    assert set(pin["block_hashes"]) == {d["block_hash"] for d in admits}

    metrics = c.get("/metrics").text
    applied = vllm_counter(metrics, "kvtier_actuations_total")
    assert applied >= n_blocks
    assert (
        'kvtier_actuations_total{action="admit",layer="vllm-warmup",outcome="applied"} '
        + f"{float(n_blocks)}"
        in metrics
    )
    assert 'kvtier_decisions_total{action="admit",tier="gpu"} ' + f"{float(n_blocks)}" in metrics

    spans: list[Any] = [s for s in sidecar.exporter.get_finished_spans() if s.name == "kvtier.actuate"]
    assert spans and spans[0].attributes["kvtier.layer"] == "vllm-warmup"
    assert spans[0].attributes["kvtier.outcome.applied"] == n_blocks
    assert sorted(spans[0].attributes["kvtier.decision_ids"]) == sorted(d["id"] for d in admits)

    status = c.get("/v1/status").json()
    assert status["mode"] == "active"
    assert status["controller"]["actuators"][0]["health"]["breaker"] == "closed"


def test_serve_path_pin_warm_then_index_confirms_and_loop_goes_quiet(
    vllm: vllm_peer.VllmServer, tmp_path: Path
) -> None:
    """The ``kvtier serve`` wiring (collectors + KV events + reconcile loop + API on one uvicorn app)."""
    from kvtier.controller.settings import Settings

    settings = Settings.model_validate(
        dict(
            engine_urls=[vllm.url],
            actuators=["vllm-warmup"],
            mode="active",
            state_dir=str(tmp_path),
            api_token=TOKEN,
            storage_enabled=False,
            scrape_interval_s=0.5,
            discovery_interval_s=0.5,
        )
    )
    sc = build_sidecar(discover_models(settings))  # as kvtier serve: the served model's name, then build
    sc.plane.loop.policy = sc.plane.loop.policy.model_copy(update={"tick_interval_s": 0.2})
    port = vllm_peer.free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(sc), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def until(cond: Any, what: str, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return v
            time.sleep(0.1)  # polling a condition with a deadline
        raise AssertionError(f"timed out waiting for {what}")

    try:
        until(lambda: server.started, "control API up")
        until(lambda: c.get("/readyz").json()["peers_up"], "collectors ready (KV events subscribed)")
        assert "/v1/pins" in c.get("/openapi.json").json()["paths"] and c.get("/docs").status_code == 200
        rng = random.Random(99)
        prefix = " ".join(f"w{rng.randrange(10**6)}" for _ in range(50))
        pin = c.post("/v1/pins", json={"prompt": prefix, "tier": "gpu"}, headers=AUTH).json()
        hashes = pin["block_hashes"]

        def applied() -> list[dict[str, Any]]:
            ds = c.get("/v1/decisions", params={"action": "admit", "limit": 100}).json()["decisions"]
            return [d for d in ds if d["block_hash"] in hashes and d["outcome"] == "applied"]

        until(lambda: len(applied()) == len(hashes), "warm-up applied by the running loop")
        # vLLM's own KV events put exactly the pinned chain in the index, in gpu (hashes recomputed by kvtier)
        until(
            lambda: all(c.get(f"/v1/blocks/{h}").json().get("tiers") == ["gpu"] for h in hashes),
            "BlockStored events for the warmed chain",
        )
        confirmed = applied()
        ticks = c.get("/v1/status").json()["controller"]["tick"]
        until(lambda: c.get("/v1/status").json()["controller"]["tick"] >= ticks + 3, "more ticks")
        assert len(applied()) == len(confirmed)  # level-based: satisfied pins cause no further warm-ups
        # before the index confirmed, a warm-up is re-sent only as the unmet pin's retry: the whole chain,
        # at least pin_retry_s after the previous one returned (a loaded CI machine can delay KV events)
        by_tick: dict[int, list[dict[str, Any]]] = {}
        for d in confirmed:
            by_tick.setdefault(d["tick"], []).append(d)
        sends = [by_tick[t] for t in sorted(by_tick)]
        assert all(sorted(d["block_hash"] for d in g) == sorted(hashes) for g in sends), sends
        retry_s = sc.plane.loop.policy.pin_retry_s
        starts = [g[0]["at_s"] for g in sends]
        assert all(b - a >= retry_s for a, b in zip(starts, starts[1:], strict=False)), starts
        st = c.get("/v1/status").json()
        assert st["mode"] == "active" and st["blocks_tracked"]["gpu"] >= len(hashes)
        assert st["controller"]["actuators"][0]["name"] == "vllm-warmup"
        assert st["controller"]["last_tick"]["outcome"] == "ok"
        hits0 = vllm_counter(vllm.metrics_text(), "vllm:prefix_cache_hits_total")
        vllm.complete(prefix + " tail", max_tokens=1)
        gained = vllm_counter(vllm.metrics_text(), "vllm:prefix_cache_hits_total") - hits0
        assert gained >= len(hashes) * vllm_peer.BLOCK_SIZE
    finally:
        server.should_exit = True
        th.join(timeout=30)
