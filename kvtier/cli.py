"""The ``kvtier`` command line: each subsystem registers its own subcommands here."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvtier",
    help="kvtier: learned KV-cache tiering for vLLM / LMCache / Mooncake, with a what-if replay harness.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Each module adds its commands to ``app`` (one line per subsystem keeps merges trivial).
    from kvtier.controller import serve as _serve
    from kvtier.replay import cli as _replay_cli  # noqa: F401  (replay, compare)

    _serve.register(app)  # serve
    from kvtier.controller import cli as _control_cli

    _control_cli.register(app)  # shadow-replay
    from kvtier.controller import demo as _demo

    _demo.register(app)  # demo
    from kvtier.replay import live_bench_cli as _bench_cli

    _bench_cli.register(app)  # bench


def main() -> None:
    """Console-script entry point."""
    _register()
    app()


if __name__ == "__main__":
    main()
