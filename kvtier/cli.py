"""The ``kvtier`` command line: each subsystem registers its own subcommands here."""

from __future__ import annotations

import typer

from kvtier import __version__

app = typer.Typer(
    name="kvtier",
    help="kvtier: learned KV-cache tiering for vLLM / LMCache / Mooncake, with a what-if replay harness.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # help texts write defaults as "[default]"; rich markup would read them as tags and drop them
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvtier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """kvtier: learned KV-cache tiering for vLLM / LMCache / Mooncake, with a what-if replay harness."""


def _register() -> None:
    # Each module adds its commands to ``app`` (one line per subsystem keeps merges trivial).
    from kvtier.controller import serve as _serve
    from kvtier.replay import cli as _replay_cli

    _replay_cli.register(app)  # replay, compare

    _serve.register(app)  # serve
    from kvtier.controller import cli as _control_cli

    _control_cli.register(app)  # shadow-replay
    from kvtier.controller import demo as _demo

    _demo.register(app)  # demo
    from kvtier.replay import live_bench_cli as _bench_cli

    _bench_cli.register(app)  # bench


def main() -> None:
    """Console-script entry point: click's usage errors become the one-line ``kvtier <command>: ...``."""
    import sys

    from kvtier.usage import click_exceptions

    _register()
    try:
        rv = app(prog_name="kvtier", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:  # bare ``kvtier``: the help text, as before
        print(exc.format_message(), file=sys.stderr)
        sys.exit(2)
    except click_exceptions.UsageError as exc:
        cmd = exc.ctx.command_path if exc.ctx is not None else "kvtier"
        msg = " ".join(exc.format_message().split())
        print(f"{cmd}: {msg} (see '{cmd} --help')", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("kvtier: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
