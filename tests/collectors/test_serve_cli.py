"""`kvtier serve` as a real process: settings precedence, a down peer never stops the others, /readyz says
what is down, a cache-layer flag builds its collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvtier.controller.settings import load_settings
from tests.peers.sidecar import wait_for
from tests.peers.vllm import free_port


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(
        'engine_urls = ["http://127.0.0.1:1"]\nlisten = "127.0.0.1:9000"\nscrape_interval_s = 7.0\n'
        '[tier_paths]\ndisk = "/tmp"\n'
    )
    monkeypatch.setenv("KVTIER_SCRAPE_INTERVAL_S", "3")
    s = load_settings(cfg, listen="127.0.0.1:9001")
    assert s.collectors.engine_urls == ["http://127.0.0.1:1"] and s.collectors.tier_paths == {"disk": "/tmp"}
    assert s.collectors.scrape_interval_s == 3.0  # env beats file
    assert s.serve.listen_host_port == ("127.0.0.1", 9001)  # flag beats both
    monkeypatch.setenv("KVTIER_ENGINE_URLS", "127.0.0.1:2,http://127.0.0.1:3/")
    assert load_settings(cfg).collectors.engine_urls == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json"):
        load_settings(bad)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ("disk=/mnt/kv-l2", {"disk": "/mnt/kv-l2"}),  # docker-compose.yml's form
        (" disk=/a , remote=/b=c,", {"disk": "/a", "remote": "/b=c"}),
        ('{"disk": "/mnt/kv-l2"}', {"disk": "/mnt/kv-l2"}),
        ("", {}),
    ],
)
def test_tier_paths_env_forms(monkeypatch: pytest.MonkeyPatch, env: str, want: dict[str, str]) -> None:
    monkeypatch.setenv("KVTIER_TIER_PATHS", env)
    assert load_settings().collectors.tier_paths == want


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ("disk", "tier=path"),
        ("=/a", "tier=path"),
        ("{disk", "invalid JSON"),
        ('["/a"]', "tier=path"),
        ("a=/x,a=/y", "given twice"),
    ],  # fmt: skip
)
def test_tier_paths_env_errors(monkeypatch: pytest.MonkeyPatch, env: str, match: str) -> None:
    monkeypatch.setenv("KVTIER_TIER_PATHS", env)
    with pytest.raises(ValueError, match=match):
        load_settings()


def _serve(work: Path, *args: str) -> subprocess.Popen[bytes]:
    """``kvtier serve`` with its state under ``work/state`` and its output in ``work/serve.log`` (a file, not
    a pipe nobody reads: a chatty child would block on a full pipe)."""
    env = dict(os.environ, KVTIER_SCRAPE_INTERVAL_S="0.3", KVTIER_DISCOVERY_INTERVAL_S="0.3",
               KVTIER_STORAGE_INTERVAL_S="0.3")  # fmt: skip
    with open(work / "serve.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--state-dir", str(work / "state"),
                                 *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)  # fmt: skip


def test_down_engine_does_not_stop_the_sidecar(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    p = _serve(tmp_path, "--engine-url", f"http://127.0.0.1:{dead}", "--listen", f"127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}"
    try:
        r = wait_for(lambda: (x := httpx.get(url + "/readyz", timeout=2)).json()["down"] and x, 60,
                     "readyz names the engine")  # fmt: skip
        assert r.status_code == 200  # an engine is configured: the sidecar is ready, the peer is not
        down = r.json()["down"]
        assert set(down) == {f"vllm_metrics:127.0.0.1:{dead}", f"vllm_kv_events:127.0.0.1:{dead}"}, down
        assert r.json()["collectors"]["storage"] is True  # the other collectors keep working
        assert httpx.get(url + "/healthz", timeout=2).status_code == 200
        st = httpx.get(url + "/v1/status", timeout=2).json()
        assert st["engines"][0]["up"] is False and st["kv_events_lost"] == 0
        assert st["storage"]["health"]["up"] is True
        text = httpx.get(url + "/metrics", timeout=2).text
        want = f'kvtier_collector_errors_total{{collector="vllm_metrics:127.0.0.1:{dead}"}}'
        errs = [ln for ln in text.splitlines() if ln.startswith(want)]
        assert errs and float(errs[0].split()[-1]) >= 1
        assert "kvtier_storage_device_read_bytes_total" in text and "kvtier_blocks_tracked" in text
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_cache_layer_flag_builds_its_collector(tmp_path: Path) -> None:
    from kvtier.controller.root import build_sidecar
    from kvtier.controller.settings import Settings

    s = dict(mooncake_urls=["http://127.0.0.1:1"], storage_enabled=False, state_dir=str(tmp_path))
    sc = build_sidecar(Settings.model_validate(s))
    assert [c.kind for c in sc.collectors.cache_collectors] == ["mooncake"]
    layers = json.loads(json.dumps(sc.status()))["cache_layers"]
    assert [(c["kind"], c["url"]) for c in layers] == [("mooncake", "http://127.0.0.1:1")]


@pytest.mark.parametrize(
    "env", ['["127.0.0.1:1", "http://127.0.0.1:2/"]', "127.0.0.1:1, http://127.0.0.1:2/"]
)
def test_lmcache_controller_urls_env_forms(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv("KVTIER_LMCACHE_CONTROLLER_URLS", env)
    assert load_settings().collectors.lmcache_controller_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_down_lmcache_controller_is_named_by_readyz_and_counted(tmp_path: Path) -> None:
    """``--lmcache-controller-url`` builds the collector: /v1/status lists it, /readyz names it while the
    controller is down, its failures are counted (live: tests/cachelayers/test_lmcache_controller_live.py)."""
    port, dead = free_port(), free_port()
    p = _serve(tmp_path, "--lmcache-controller-url", f"127.0.0.1:{dead}", "--listen", f"127.0.0.1:{port}")
    url, name = f"http://127.0.0.1:{port}", f"lmcache_controller:127.0.0.1:{dead}"
    try:
        r = wait_for(lambda: (x := httpx.get(url + "/readyz", timeout=2)).json()["down"] and x, 60,
                     "readyz names the controller")  # fmt: skip
        assert r.status_code == 503 and "no engine configured" in r.json()["reasons"][0]
        assert set(r.json()["down"]) == {name} and r.json()["collectors"]["storage"] is True
        layers = httpx.get(url + "/v1/status", timeout=2).json()["cache_layers"]
        assert [(c["name"], c["kind"], c["url"]) for c in layers] == [
            (name, "lmcache_controller", f"http://127.0.0.1:{dead}")
        ]
        assert layers[0]["health"]["up"] is False and layers[0]["health"]["errors_by_kind"]["fetch"] >= 1
        text = httpx.get(url + "/metrics", timeout=2).text
        want = f'kvtier_collector_errors_total{{collector="{name}"}}'
        errs = [ln for ln in text.splitlines() if ln.startswith(want)]
        assert errs and float(errs[0].split()[-1]) >= 1
    finally:
        p.terminate()
        p.wait(timeout=30)
