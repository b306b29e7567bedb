"""``kvtier serve``: run the sidecar (collectors + API) on ``--listen``."""

from __future__ import annotations

import gc
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
        help="Config file: YAML (.yaml/.yml), JSON (.json) or TOML; KVTIER_* env overrides it.",
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
) -> None:
    """Watch vLLM (metrics + KV events), cache layers and storage; serve /metrics, /v1/status, /readyz;
    run the reconcile loop and the policy API (/v1/policy, /v1/pins, /v1/decisions, ...; OpenAPI at /docs)."""
    import logging

    import uvicorn

    from kvtier import __version__
    from kvtier.controller.control_sidecar import ControlledSidecar, create_controlled_app
    from kvtier.controller.logs import configure_logging
    from kvtier.controller.settings import load_settings
    from kvtier.controller.sidecar import PeerNotAvailable
    from kvtier.usage import check_listen, describe, fail

    try:
        settings = load_settings(
            config, engine_urls=engine_url or None, lmcache_urls=lmcache_url or None,
            mooncake_urls=mooncake_url or None, lmcache_controller_urls=lmcache_controller_url or None,
            listen=listen, mode=mode, actuators=actuator or None,
            state_dir=str(state_dir) if state_dir else None, log_json=log_json, policy=policy,
            policy_tier=policy_tier,
        )  # fmt: skip
        host, port = settings.serve.listen_host_port
        configure_logging(settings.serve.log_level, json_lines=settings.serve.log_json)
        sidecar = ControlledSidecar(settings, reset_state=reset_state)
    except (PeerNotAvailable, ValueError, OSError) as exc:
        fail(describe(exc))
    check_listen(host, port)  # a busy port is one line now, not a traceback after start-up
    logging.getLogger("kvtier.serve").info("kvtier %s: %s", __version__, sidecar.startup_summary())
    from kvtier.controller.status_page import install_status_page

    app = create_controlled_app(sidecar)
    install_status_page(app, sidecar.registry)  # the status page at /
    # the ~100k objects of the imported modules live forever: keep them out of the cyclic GC, whose full
    # collections would otherwise cost tens of ms each (a tick-latency spike when one lands in a tick)
    gc.freeze()
    # log_config=None: uvicorn keeps configure_logging's handler (JSON lines, quiet probe paths)
    uvicorn.run(app, host=host, port=port, log_level=settings.serve.log_level.lower(), log_config=None)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
