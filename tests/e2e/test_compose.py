"""``docker-compose.yml`` validated by the REAL compose client (``docker compose`` plugin, else Debian's
``docker-compose``; no Docker engine is needed for ``config``), plus the files it mounts and builds from, and
the kvtier services' flags and ``KVTIER_*`` environment checked against the real CLI and ``Settings``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml
from typer.core import TyperGroup

from kvtier.controller import demo as demo_cli
from kvtier.controller import serve as serve_cli
from kvtier.controller.settings import FLAT_ENV, Settings, load_settings
from tests.peers.procs import free_port, start, stop, wait_for

REPO = Path(__file__).resolve().parents[2]
PROFILES = {
    "gpu": {"vllm", "lmcache", "kvtier"},
    "cpu": {"vllm-cpu", "lmcache-cpu", "kvtier"},
    "demo": {"kvtier-demo"},
}
ALWAYS = {"prometheus", "grafana", "otel-collector"}


pytestmark = pytest.mark.compose  # every test renders through the real compose client


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
    full_env.setdefault("KVTIER_API_TOKEN", "compose-test-token")  # the file requires one (0.0.0.0 bind)
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

    def config(f: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose_cmd(), "-f", str(f), "config", "-q"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )

    r = config(bad)
    # rejected for the reason planted (the mapping where a list belongs), not for a missing client or file
    assert r.returncode != 0 and "ports" in r.stdout + r.stderr, r.stdout + r.stderr
    good = tmp_path / "good.yml"
    good.write_text(bad.read_text().replace("{not: a list}", '["8080:80"]'))
    ok = config(good)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def kvtier_services() -> dict[str, dict[str, Any]]:
    """Every service of every profile that runs the kvtier image (built from the repo's ``Dockerfile``)."""
    doc = rendered(*(a for p in sorted(PROFILES) for a in ("--profile", p)))
    out = {n: s for n, s in doc["services"].items() if str(s.get("image", "")).startswith("kvtier:")}
    assert set(out) == {"kvtier", "kvtier-demo"}, sorted(out)
    return out


def dockerfile() -> tuple[dict[str, str], list[str]]:
    """The kvtier ``Dockerfile``'s ``KVTIER_*`` ``ENV`` values and its ``CMD``."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.*)$", text, re.M):
        env.update(dict(re.findall(r"(KVTIER_\w+)=(\S+)", line)))
    cmd = json.loads(re.findall(r"^CMD (.*)$", text, re.M)[-1])
    return env, cmd


def cli_group() -> TyperGroup:
    """The real ``kvtier serve`` / ``kvtier demo`` commands (a fresh Typer app: kvtier.cli registers once)."""
    app = typer.Typer()
    serve_cli.register(app)
    demo_cli.register(app)
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return group


def kvtier_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(str(x).split("=", 1) for x in env)
    return {k: str(v) for k, v in env.items() if k.startswith("KVTIER_")}


def test_every_kvtier_env_var_loads_into_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``KVTIER_*`` value of each kvtier service (and the image's ``ENV``) is a real Settings field and
    parses; the environment source ignores unknown ``KVTIER_*`` names, so a misspelt one would otherwise pass
    silently."""
    image_env, _ = dockerfile()
    cases = {"Dockerfile": image_env} | {n: image_env | kvtier_env(s) for n, s in kvtier_services().items()}
    assert cases["kvtier"], "the kvtier service sets no KVTIER_* variable?"
    for where, env in cases.items():
        for k in [k for k in os.environ if k.startswith("KVTIER_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            assert k.removeprefix("KVTIER_").lower() in FLAT_ENV, f"{where}: {k} is no setting"
            monkeypatch.setenv(k, v)
        s = load_settings()
        assert s.serve.state_dir == "/var/lib/kvtier", where
        if where == "kvtier":
            assert s.collectors.tier_paths == {"disk": "/mnt/kv-l2"}


def test_kvtier_commands_parse_with_the_real_cli() -> None:
    """Each kvtier service's command (and the image's default CMD) parses with ``kvtier``'s own options."""
    group = cli_group()
    _, image_cmd = dockerfile()
    commands = {"Dockerfile CMD": image_cmd} | {n: s["command"] for n, s in kvtier_services().items()}
    for where, cmd in commands.items():
        sub, *args = cmd
        assert sub in group.commands, f"{where}: no `kvtier {sub}`"
        try:
            ctx = group.commands[sub].make_context(sub, list(args))
        except Exception as exc:  # typer's vendored click: UsageError, BadParameter, ...
            pytest.fail(f"{where}: `kvtier {' '.join(cmd)}`: {exc}")
        assert ctx.params["listen"] == "0.0.0.0:8787", where
    serve = kvtier_services()["kvtier"]["command"]
    params = group.commands["serve"].make_context("serve", serve[1:]).params
    token = kvtier_env(kvtier_services()["kvtier"])["KVTIER_API_TOKEN"]  # 0.0.0.0 needs one (from .env)
    s = Settings.model_validate(
        dict(
            mode=params["mode"],
            actuators=params["actuator"],
            engine_urls=params["engine_url"],
            lmcache_urls=params["lmcache_url"],
            listen=params["listen"],
            api_token=token,
        )
    )
    assert s.serve.mode == "shadow" and [a.kind for a in s.actuators] == ["lmcache-mp"]
    assert s.collectors.engine_urls == ["http://vllm:8000"] and s.collectors.lmcache_urls == [
        "http://lmcache:8080"
    ]


def test_compose_kvtier_serve_starts() -> None:
    """``kvtier serve`` with the compose service's flags and KVTIER_* env (peers unreachable here; only the
    address and state dir changed) comes up and answers /healthz."""
    svc = kvtier_services()["kvtier"]
    port = free_port()
    wd = Path(tempfile.mkdtemp(prefix="kvtier-compose-"))
    args = [a if not a.startswith("--listen=") else f"--listen=127.0.0.1:{port}" for a in svc["command"]]
    env = kvtier_env(svc) | {"KVTIER_STATE_DIR": str(wd / "state")}
    proc = start([sys.executable, "-m", "kvtier", *args], wd / "kvtier.log", env=env)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200, 120,
                 "kvtier serve with the compose settings", proc=proc, log=wd / "kvtier.log")  # fmt: skip
    finally:
        stop(proc)
        shutil.rmtree(wd, ignore_errors=True)


def test_demo_keeps_serving_after_the_trace() -> None:
    """The demo exits at the trace's end: compose starts it again (else KvtierSidecarDown, empty boards)."""
    for name, svc in kvtier_services().items():
        assert svc.get("restart") in ("always", "unless-stopped"), name


def test_compose_refuses_to_start_kvtier_without_a_token() -> None:
    """kvtier listens on 0.0.0.0 inside its container: compose names the missing token instead of starting."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_API_TOKEN"}
    cmd = [*compose_cmd(), "-f", str(REPO / "docker-compose.yml"), "--profile", "demo", "config", "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False)
    assert r.returncode != 0 and "KVTIER_API_TOKEN" in r.stderr, r.stderr
    doc = rendered("--profile", "demo", env={"KVTIER_API_TOKEN": "t0ken"})
    assert doc["services"]["kvtier-demo"]["environment"]["KVTIER_API_TOKEN"] == "t0ken"
    for name, svc in kvtier_services().items():  # published on loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in svc.get("ports", [])), name


def test_dockerfile_runs_as_a_number_with_state_and_tmp_volumes() -> None:
    text = (REPO / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or gid.isdigit()), user  # runAsNonRoot checks a number
    (vol,) = re.findall(r"^VOLUME (.*)$", text, re.M)
    assert set(json.loads(vol)) == {"/var/lib/kvtier", "/tmp"}
    health = re.search(r"^HEALTHCHECK .*?CMD (.*)$", text.replace("\\\n", " "), re.M | re.S)
    assert health and "HEALTHCHECK_PORT" in health.group(1) and ":8787/" not in health.group(1)
