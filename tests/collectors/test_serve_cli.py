"""`kvtier serve` as a real process: settings precedence, a down peer never stops the others, /readyz says
what is down, unknown cache-layer collectors give a clear error."""

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
    assert s.engine_urls == ["http://127.0.0.1:1"] and s.tier_paths == {"disk": "/tmp"}
    assert s.scrape_interval_s == 3.0  # env beats file
    assert s.listen_host_port == ("127.0.0.1", 9001)  # flag beats both
    monkeypatch.setenv("KVTIER_ENGINE_URLS", "127.0.0.1:2,http://127.0.0.1:3/")
    assert load_settings(cfg).engine_urls == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
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
    assert load_settings().tier_paths == want


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


def _serve(*args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, KVTIER_SCRAPE_INTERVAL_S="0.3", KVTIER_DISCOVERY_INTERVAL_S="0.3",
               KVTIER_STORAGE_INTERVAL_S="0.3")  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "kvtier", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def test_down_engine_does_not_stop_the_sidecar() -> None:
    port, dead = free_port(), free_port()
    p = _serve("--engine-url", f"http://127.0.0.1:{dead}", "--listen", f"127.0.0.1:{port}")
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


def test_cache_layer_flag_without_collector_module_is_a_clear_error() -> None:
    try:
        import kvtier.collectors.mooncake  # noqa: F401
    except ImportError:
        p = _serve("--mooncake-url", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}")
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 2 and b"not available" in out, out
    else:  # the cache-layer collectors are merged: the flag builds them
        from kvtier.controller.settings import Settings
        from kvtier.controller.sidecar import Sidecar

        sc = Sidecar(Settings(mooncake_urls=["http://127.0.0.1:1"], storage_enabled=False))
        assert [c.kind for c in sc.cache_collectors] and json.dumps(sc.status())


@pytest.mark.parametrize(
    "env", ['["127.0.0.1:1", "http://127.0.0.1:2/"]', "127.0.0.1:1, http://127.0.0.1:2/"]
)
def test_lmcache_controller_urls_env_forms(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv("KVTIER_LMCACHE_CONTROLLER_URLS", env)
    assert load_settings().lmcache_controller_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_down_lmcache_controller_is_named_by_readyz_and_counted(tmp_path: Path) -> None:
    """``--lmcache-controller-url`` builds the collector: /v1/status lists it, /readyz names it while the
    controller is down, its failures are counted (live: tests/cachelayers/test_lmcache_controller_live.py)."""
    port, dead = free_port(), free_port()
    p = _serve("--lmcache-controller-url", f"127.0.0.1:{dead}", "--listen", f"127.0.0.1:{port}",
               "--state-dir", str(tmp_path))  # fmt: skip
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
