"""``kvtier serve``: run the sidecar (collectors + API) on ``--listen``."""

from __future__ import annotations

import logging
from pathlib import Path

import typer


def serve(
    engine_url: list[str] = typer.Option(None, "--engine-url", help="vLLM API server URL (repeatable)."),
    lmcache_url: list[str] = typer.Option(None, "--lmcache-url", help="LMCache MP server URL (repeatable)."),
    mooncake_url: list[str] = typer.Option(None, "--mooncake-url", help="Mooncake master URL (repeatable)."),
    listen: str = typer.Option(None, "--listen", help="HOST:PORT to serve on [127.0.0.1:8787]."),
    config: Path = typer.Option(None, "--config", help="Config file (JSON or TOML); KVTIER_* env overrides it."),
) -> None:
    """Watch vLLM (metrics + KV events), cache layers and storage; serve /metrics, /v1/status, /readyz."""
    import uvicorn

    from kvtier.controller.app import create_app
    from kvtier.controller.settings import load_settings
    from kvtier.controller.sidecar import PeerNotAvailable, Sidecar

    try:
        settings = load_settings(
            config, engine_urls=engine_url or None, lmcache_urls=lmcache_url or None,
            mooncake_urls=mooncake_url or None, listen=listen,
        )  # fmt: skip
        host, port = settings.listen_host_port
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        sidecar = Sidecar(settings)
    except (PeerNotAvailable, ValueError, OSError) as exc:
        typer.echo(f"kvtier serve: {exc}", err=True)
        raise typer.Exit(2) from exc
    uvicorn.run(create_app(sidecar), host=host, port=port, log_level=settings.log_level.lower())


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
