"""``kvtier serve``: run the sidecar (collectors + API) on ``--listen``."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import typer


def serve(
    engine_url: list[str] = typer.Option(None, "--engine-url", help="vLLM API server URL (repeatable)."),
    lmcache_url: list[str] = typer.Option(None, "--lmcache-url", help="LMCache MP server URL (repeatable)."),
    mooncake_url: list[str] = typer.Option(None, "--mooncake-url", help="Mooncake master URL (repeatable)."),
    lmcache_controller_url: list[str] = typer.Option(
        None, "--lmcache-controller-url", help="Legacy LMCache cache-controller URL (repeatable)."
    ),
    listen: str = typer.Option(None, "--listen", help="HOST:PORT to serve on [127.0.0.1:8787]."),
    config: Path = typer.Option(
        None,
        "--config",
        help="Config file: YAML (.yaml/.yml), JSON (.json) or TOML; unknown keys are errors; env wins.",
    ),
    mode: str = typer.Option(None, "--mode", help="off | shadow | active [persisted policy; shadow]."),
    actuator: list[str] = typer.Option(
        None,
        "--actuator",
        help="shadow | vllm-warmup | lmcache-mp | mooncake | lmcache-controller (repeatable) [none].",
    ),
    state_dir: Path = typer.Option(None, "--state-dir", help="Policy/pins/model kept here [.kvtier-state]."),
    log_json: bool = typer.Option(None, "--log-json", help="JSON-lines logs."),
    policy: str = typer.Option(
        None, "--policy", help="Placement policy: a registry name (lru, s3fifo, ...) or none [learned]."
    ),
    policy_tier: str = typer.Option(None, "--policy-tier", help="Tier that policy places [cpu]."),
    reset_state: bool = typer.Option(
        False, "--reset-state", help="Forget the policy persisted by PATCH/PUT /v1/policy, then start."
    ),
    allow_active: bool = typer.Option(
        None, "--allow-active", help="Let the API switch mode to active (implied by --mode active)."
    ),
    insecure_no_auth: bool = typer.Option(
        None, "--insecure-no-auth", help="Serve a non-loopback --listen without KVTIER_API_TOKEN (unsafe)."
    ),
) -> None:
    """Watch vLLM (metrics + KV events), cache layers and storage; serve /metrics, /v1/status, /readyz;
    run the reconcile loop and the policy API (/v1/policy, /v1/pins, /v1/decisions, ...; OpenAPI at /docs)."""
    import logging

    import uvicorn

    from kvtier import __version__
    from kvtier.controller.app import create_app
    from kvtier.controller.collection import PeerNotAvailable
    from kvtier.controller.logs import configure_logging
    from kvtier.controller.root import build_sidecar, discover_models
    from kvtier.controller.settings import load_settings
    from kvtier.usage import check_listen, describe, fail

    try:
        settings = load_settings(
            config, engine_urls=engine_url or None, lmcache_urls=lmcache_url or None,
            mooncake_urls=mooncake_url or None, lmcache_controller_urls=lmcache_controller_url or None,
            listen=listen, mode=mode, actuators=actuator or None,
            state_dir=str(state_dir) if state_dir else None, log_json=log_json, policy=policy,
            policy_tier=policy_tier, allow_active=allow_active, insecure_no_auth=insecure_no_auth,
        )  # fmt: skip
        host, port = settings.serve.listen_host_port
        configure_logging(settings.serve.log_level, json_lines=settings.serve.log_json)
        if settings.serve.cpu_nice:  # before any thread starts: every thread inherits it
            os.nice(settings.serve.cpu_nice)
        settings = discover_models(settings)  # the one blocking look-up, before anything is built
        sidecar = build_sidecar(settings, reset_state=reset_state)
    except (PeerNotAvailable, ValueError, OSError) as exc:
        fail(describe(exc))
    check_listen(host, port)  # a busy port is one line now, not a traceback after start-up
    from kvtier.controller.guard import is_loopback
    from kvtier.controller.http_protocol import deadline_protocol

    slog = logging.getLogger("kvtier.serve")
    slog.info("kvtier %s: %s", __version__, sidecar.startup_summary())
    if settings.serve.api_token is None and not is_loopback(host):
        slog.critical(
            "INSECURE: --listen %s without KVTIER_API_TOKEN (--insecure-no-auth): anyone who can reach this "
            "port can change the policy, pins and mode", settings.serve.listen,
        )  # fmt: skip
    elif settings.serve.api_token is None:
        slog.warning(
            "no KVTIER_API_TOKEN: API mutations are open to local processes on %s", settings.serve.listen
        )
    from kvtier.controller.status_page import install_status_page

    app = create_app(sidecar)
    install_status_page(app, sidecar.registry)  # the status page at /
    # the ~100k objects of the imported modules live forever: keep them out of the cyclic GC, whose full
    # collections would otherwise cost tens of ms each (a tick-latency spike when one lands in a tick)
    gc.freeze()
    # log_config=None: uvicorn keeps configure_logging's handler (JSON lines, quiet probe paths)
    sv = settings.serve
    uvicorn.run(
        app, host=host, port=port, log_level=sv.log_level.lower(), log_config=None,
        limit_concurrency=sv.http_max_inflight * 4,  # connections; the guard limits requests in flight
        timeout_keep_alive=int(max(1, sv.http_keepalive_s)),
        h11_max_incomplete_event_size=32 * 1024,  # request line + headers, bytes
        timeout_graceful_shutdown=3,  # SIGTERM: open connections get 3 s, then the sidecar stops
        http=deadline_protocol(sv.http_request_deadline_s),  # half-sent requests are closed
    )  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
