"""What an operator sees of a running ``kvtier serve`` (a real process on a free 127.0.0.1 port): one version
everywhere (``--version``, ``kvtier_build_info``, ``/openapi.json``), the process collectors, ``/readyz``
about the sidecar itself, and ``/docs`` rendered from bundled assets with no network (headless Chromium)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.peers.sidecar import wait_for
from tests.peers.vllm import free_port

KVTIER = [sys.executable, "-m", "kvtier"]


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=5)


def _serve(tmp_path: Path, *args: str) -> Iterator[Served]:
    port = free_port()
    env = dict(os.environ, KVTIER_SCRAPE_INTERVAL_S="0.3", KVTIER_DISCOVERY_INTERVAL_S="0.3")
    env.pop("KVTIER_ENGINE_URLS", None)
    p = subprocess.Popen(
        [*KVTIER, "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    s = Served(p, f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: p.poll() is None and s.get("/healthz").status_code == 200, 60, "kvtier serve up")
        yield s
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.fixture(scope="module")
def dead_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``kvtier serve`` with an engine URL nobody listens on."""
    yield from _serve(tmp_path_factory.mktemp("serve"), "--engine-url", f"http://127.0.0.1:{free_port()}")


def test_one_version_everywhere(dead_engine: Served) -> None:
    out = subprocess.run([*KVTIER, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.fullmatch(r"kvtier (\S+)\n", out)
    assert m, out
    version = m.group(1)
    assert dead_engine.get("/openapi.json").json()["info"]["version"] == version
    metrics = dead_engine.get("/metrics").text
    build = [ln for ln in metrics.splitlines() if ln.startswith("kvtier_build_info{")]
    assert len(build) == 1 and f'version="{version}"' in build[0] and build[0].endswith(" 1.0"), build
    # the process and platform collectors (resident memory, CPU, open fds, python_info)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info{"):
        assert any(ln.startswith(name) for ln in metrics.splitlines()), name


def test_readyz_is_about_the_sidecar_not_its_peers(dead_engine: Served) -> None:
    """The engine is down, yet the sidecar is ready: as a native sidecar its readiness gates the vLLM pod."""
    r = wait_for(lambda: (x := dead_engine.get("/readyz")).json()["down"] and x, 30, "engine reported down")
    assert r.status_code == 200 and r.json()["ready"] is True and r.json()["peers_up"] is False
    assert any(k.startswith("vllm_metrics:") for k in r.json()["down"])


def test_no_engine_is_not_ready(tmp_path: Path) -> None:
    for s in _serve(tmp_path):
        r = s.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        assert any("no engine configured" in x for x in r.json()["reasons"]), r.json()
        assert s.get("/healthz").status_code == 200  # alive: the liveness probe must not restart it


def test_docs_page_references_only_bundled_assets(dead_engine: Served) -> None:
    html = dead_engine.get("/docs").text
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", html)
    assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN
    for u in urls:
        assert dead_engine.get(u).status_code == 200, u


@pytest.mark.browser
@pytest.mark.slow
def test_docs_render_offline_in_chromium(dead_engine: Served, tmp_path: Path) -> None:
    """Chromium resolves no host but 127.0.0.1 (``--host-resolver-rules``): a CDN asset could not load."""
    from PIL import Image

    from tests.e2e import browser

    offline = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
    dom = browser.run(["--virtual-time-budget=8000", offline, "--dump-dom", dead_engine.url + "/docs"], 120)
    assert 'class="swagger-ui' in dom.stdout and "/readyz" in dom.stdout, dom.stdout[-2000:]
    assert "opblock" in dom.stdout  # operations were rendered from /openapi.json
    png = Path(os.environ.get("KVTIER_DOCS_PNG", tmp_path / "docs.png"))
    browser.run(
        ["--window-size=1280,900", "--virtual-time-budget=8000", offline, f"--screenshot={png}",
         dead_engine.url + "/docs"],
        120,
    )  # fmt: skip
    img = Image.open(png).convert("RGB")
    colors = img.getcolors(maxcolors=1_000_000) or []
    assert len(colors) > 50, len(colors)  # text, headings and coloured method badges, not a blank page
    top = max(n for n, _ in colors)
    assert top < 0.97 * img.width * img.height  # not one flat colour


def test_json_logs_cover_uvicorn_and_skip_probe_paths_and_repeat_peer_warnings(tmp_path: Path) -> None:
    """--log-json: uvicorn's own lines are JSON too; /metrics and probes stay out of the access log; a down
    engine is one warning (then a reminder every 5 minutes), not one per 0.3 s poll."""
    gen = _serve(tmp_path, "--log-json", "--engine-url", f"http://127.0.0.1:{free_port()}")
    s = next(gen)
    wait_for(lambda: s.get("/readyz").json()["down"], 30, "engine down")
    for path in ("/metrics", "/healthz", "/readyz", "/v1/status"):
        assert s.get(path).status_code < 500
    # several failed polls per collector (0.3 s apart) happen before we stop
    wait_for(lambda: "kvtier_collector_errors_total" in (t := s.get("/metrics").text)
             and all(float(ln.split()[-1]) >= 5 for ln in t.splitlines()
                     if ln.startswith("kvtier_collector_errors_total{collector=\"vllm_metrics")), 30,
             "5 failed polls")  # fmt: skip
    with pytest.raises(StopIteration):
        next(gen)  # stops the server
    assert s.proc.stdout is not None
    lines = s.proc.stdout.read().decode().splitlines()
    records = [json.loads(ln) for ln in lines]  # every line is JSON, uvicorn's included
    assert any(r["logger"].startswith("uvicorn") for r in records)
    access = [r["msg"] for r in records if r["logger"] == "uvicorn.access"]
    assert any("/v1/status" in m for m in access), access
    assert not [m for m in access if any(p in m for p in ("/metrics", "/healthz", "/readyz"))], access
    down = [r["msg"] for r in records if r["level"] == "warning" and "vllm_metrics" in r["msg"]]
    assert len(down) == 1 and "down" in down[0], down


def test_openapi_declares_bearer_auth_readable_ids_and_typed_probes(dead_engine: Served) -> None:
    spec = dead_engine.get("/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert any(s == {**s, "type": "http", "scheme": "bearer"} for s in schemes.values()), schemes
    ids = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            ids.append(op["operationId"])
            assert "_v1_" not in op["operationId"] and not op["operationId"].endswith(("_get", "_post")), op
            if method in ("post", "put", "patch", "delete"):
                assert op.get("security"), (method, path)
    assert len(ids) == len(set(ids)) and "get_policy" in ids and "add_pin" in ids
    ready = spec["paths"]["/readyz"]["get"]["responses"]
    assert {"200", "503"} <= set(ready) and "$ref" in ready["503"]["content"]["application/json"]["schema"]


def test_demo_is_ready_without_an_engine_url(tmp_path: Path) -> None:
    """The demo's engine is the emulated one fed by the trace: its /readyz is 200 (serve's would be 503)."""
    port = free_port()
    cmd = [*KVTIER, "demo", "--listen", f"127.0.0.1:{port}", "--speed", "5", "--state-dir", str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = wait_for(lambda: p.poll() is None and httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2), 60,
                     "demo serving")  # fmt: skip
        assert r.status_code == 200 and r.json()["ready"] is True, r.text
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_cpu_nice_lowers_the_serving_process_priority(tmp_path: Path) -> None:
    """``serve.cpu_nice`` (here from a config file): the running process, and so every thread it starts,
    runs that much nicer than its parent, so it yields shared cores to the engine; out of range is an
    error."""
    cfg = tmp_path / "nice.yaml"
    cfg.write_text("serve:\n  cpu_nice: 7\n")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for s in _serve(tmp_path, "--config", str(cfg)):
        assert os.getpriority(os.PRIO_PROCESS, s.proc.pid) == min(19, own + 7)
    cfg.write_text("serve:\n  cpu_nice: 20\n")
    r = subprocess.run([*KVTIER, "serve", "--config", str(cfg), "--listen", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "cpu_nice" in r.stderr, r.stderr
