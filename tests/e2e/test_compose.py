"""``docker-compose.yml`` validated by the REAL compose client (``docker compose`` plugin, else Debian's
``docker-compose``; no Docker engine is needed for ``config``), plus the files it mounts and builds from."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILES = {
    "gpu": {"vllm", "lmcache", "kvtier"},
    "cpu": {"vllm-cpu", "lmcache-cpu", "kvtier"},
    "demo": {"kvtier-demo"},
}
ALWAYS = {"prometheus", "grafana", "otel-collector"}


def compose_cmd() -> list[str]:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("no compose client: run scripts/setup-peers.sh (apt-get install docker-compose)")


def run_config(
    *extra: str, quiet: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``compose -f docker-compose.yml [extra] config [-q]``."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [
            *compose_cmd(),
            "-f",
            str(REPO / "docker-compose.yml"),
            *extra,
            "config",
            *(["-q"] if quiet else []),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=full_env,
        timeout=120,
        check=False,
    )


def rendered(*extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = run_config(*extra, env=env)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = yaml.safe_load(r.stdout)
    return doc


def test_compose_config_passes() -> None:
    r = run_config(quiet=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_renders(profile: str) -> None:
    doc = rendered("--profile", profile)
    services = doc["services"]
    assert PROFILES[profile] | ALWAYS <= set(services)
    for name in PROFILES[profile]:
        assert profile in services[name]["profiles"]
    for name in ALWAYS:
        assert not services[name].get("profiles")
    # Prometheus' targets resolve in this profile: a service or a network alias named vllm/lmcache/kvtier
    names = {n for n, s in services.items() if profile in (s.get("profiles") or [profile])}
    for s in services.values():
        if profile in (s.get("profiles") or [profile]):
            for net in (s.get("networks") or {}).values():
                names |= set((net or {}).get("aliases", []))
    expected = {"kvtier"} if profile == "demo" else {"kvtier", "vllm", "lmcache"}
    assert expected <= names, (profile, sorted(names))


def test_gpu_engine_flags_and_mounts() -> None:
    doc = rendered(env={"KV_L2_PATH": "/mnt/nvmeof0/kv"})
    s = doc["services"]
    vllm = " ".join(s["vllm"]["command"])
    for flag in (
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo=sha256_cbor",
        "enable_kv_cache_events",
        "LMCacheMPConnector",
        "replay_endpoint",
    ):
        assert flag in vllm, flag
    assert s["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    lm = " ".join(s["lmcache"]["command"])
    assert "--l1-size-gb" in lm and '"base_path": "/mnt/kv-l2"' in lm
    mounts = [str(v) for v in s["lmcache"]["volumes"]]
    assert any("/mnt/nvmeof0/kv" in m for m in mounts), mounts
    assert "--actuator=lmcache-mp" in s["kvtier"]["command"]


def test_mounted_and_built_files_exist() -> None:
    doc = rendered()
    for name, svc in doc["services"].items():
        for v in svc.get("volumes", []):
            src = v["source"] if isinstance(v, dict) else str(v).split(":")[0]
            if str(src).startswith(str(REPO)) and "state" not in str(src):
                assert Path(src).exists(), f"{name}: {src}"
        build = svc.get("build")
        if build:
            ctx = Path(build["context"] if isinstance(build, dict) else build)
            dockerfile = ctx / (
                build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
            )
            assert dockerfile.exists(), f"{name}: {dockerfile}"


def test_a_broken_compose_file_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: {not: a list}\n")
    r = subprocess.run(
        [*compose_cmd(), "-f", str(bad), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0
