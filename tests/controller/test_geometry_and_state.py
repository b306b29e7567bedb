"""The policy sized from the engine's own ``vllm:cache_config_info``, the effective mode/policy and their
source at start-up and in ``/v1/status``, and ``--reset-state``.

``kvtier serve`` runs as a real process. The engine is a real HTTP server on 127.0.0.1 serving a metrics
text captured from vLLM (``cache_config_info`` line verbatim); the real vLLM CPU build variant is
``test_real_vllm_sizes_the_gpu_tier`` (marked vllm/slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.controller.geometry import EngineGeometry, apply_geometry, parse_cache_config
from kvtier.controller.policy_doc import PolicyDoc
from tests.peers.http_server import MetricsText, metrics_text_handler, serving
from tests.peers.sidecar import wait_for
from tests.peers.vllm import free_port

CACHE_CONFIG = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",kv_cache_memory_bytes="1073741824",num_cpu_blocks="None",'
    'num_gpu_blocks="8192",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0\n'
)
METRICS = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
METRICS += "# TYPE vllm:cache_config_info gauge\n" + CACHE_CONFIG


def test_parse_and_apply() -> None:
    geo = parse_cache_config(METRICS)
    assert geo == EngineGeometry(16, 8192, None, "auto", 1073741824 // 8192)
    doc = apply_geometry(PolicyDoc(mode="active"), geo)
    gpu = next(t for t in doc.tiers if t.tier.value == "gpu")
    assert (gpu.capacity_blocks, doc.block_size_tokens, doc.block_bytes, doc.mode) == (
        8192,
        16,
        131072,
        "active",
    )
    assert parse_cache_config("vllm:num_requests_running 0\n") is None


class Serve:
    def __init__(self, state: Path, engine: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env |= {"KVTIER_SCRAPE_INTERVAL_S": "0.3", "KVTIER_DISCOVERY_INTERVAL_S": "0.3"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--listen", f"127.0.0.1:{self.port}", "--state-dir",
             str(state), "--engine-url", engine, *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(lambda: self.proc.poll() is None and self.get("/healthz").status_code == 200, 60, "serve up")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=5)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("/v1/status").json()
        return out

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return out.decode()


@pytest.fixture()
def engine() -> Iterator[str]:
    with serving(metrics_text_handler(MetricsText())) as url:
        MetricsText.text = METRICS
        yield url.rstrip("/")


def gpu_tier(policy: dict[str, Any]) -> int:
    return int(next(t["capacity_blocks"] for t in policy["tiers"] if t["tier"] == "gpu"))


def test_policy_sized_from_the_engine_then_api_change_survives_until_reset(
    engine: str, tmp_path: Path
) -> None:
    s = Serve(tmp_path, engine)
    try:
        st = wait_for(lambda: (x := s.status())["policy_source"]["policy"].startswith("discovered") and x, 30,
                      "policy discovered")  # fmt: skip
        assert st["engine_geometry"]["num_gpu_blocks"] == 8192 and st["policy_source"]["mode"] == "default"
        pol = wait_for(
            lambda: (p := s.get("/v1/policy").json())["block_size_tokens"] == 16 and p, 30, "committed"
        )
        assert gpu_tier(pol) == 8192
        r = httpx.patch(s.url + "/v1/policy", json={"mode": "off"}, timeout=5)
        assert r.status_code == 200, r.text
    finally:
        log1 = s.stop()
    assert "GPU tier 8192 blocks of 16 tokens" in log1, log1[-2000:]

    s = Serve(tmp_path, engine)  # the API change is in force and said so
    try:
        st = s.status()
        assert st["policy_source"] == {"mode": "api (persisted)", "policy": "api (persisted)",
                                       "state_dir": str(tmp_path)}  # fmt: skip
        assert s.get("/v1/policy").json()["mode"] == "off"
    finally:
        log2 = s.stop()
    assert "mode off (from api (persisted))" in log2 and "--reset-state" in log2, log2[-2000:]

    s = Serve(tmp_path, engine, "--reset-state")
    try:
        st = wait_for(lambda: (x := s.status())["policy_source"]["policy"].startswith("discovered") and x, 30,
                      "discovered again after the reset")  # fmt: skip
        assert st["policy_source"]["mode"] == "default"
        pol = wait_for(
            lambda: (p := s.get("/v1/policy").json())["block_size_tokens"] == 16 and p, 30, "committed"
        )
        assert pol["mode"] == "shadow" and gpu_tier(pol) == 8192
    finally:
        s.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_sizes_the_gpu_tier(tmp_path: Path) -> None:
    from tests.peers import vllm as vllm_peer

    with vllm_peer.running(num_gpu_blocks=64) as srv:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        geo = parse_cache_config(text)
        assert geo is not None and (geo.block_size_tokens, geo.num_gpu_blocks) == (vllm_peer.BLOCK_SIZE, 64)
        s = Serve(tmp_path, srv.url)
        try:
            st = wait_for(lambda: (x := s.status())["policy_source"]["policy"].startswith("discovered") and x,
                          60, "policy discovered from the real vLLM")  # fmt: skip
            assert st["engine_geometry"]["num_gpu_blocks"] == 64
            pol = wait_for(
                lambda: (p := s.get("/v1/policy").json()) and gpu_tier(p) == 64 and p, 30, "committed"
            )
            assert pol["block_size_tokens"] == vllm_peer.BLOCK_SIZE
        finally:
            s.stop()
