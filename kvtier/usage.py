"""User errors of the ``kvtier`` command line: one line on stderr, ``kvtier <command>: <what>``, exit 2.

Every subcommand reports bad input (missing file, malformed trace, unknown name, busy port, missing extra)
through :func:`fail`, so the prefix and the exit status are the same everywhere and no traceback reaches
the user; ``kvtier.cli.main`` turns click's own usage errors into the same one line.
"""

from __future__ import annotations

import socket
from typing import NoReturn

import typer
from pydantic import ValidationError

try:  # typer >= 0.2x vendors click as typer._click; older releases run on click itself
    from typer._click import exceptions as click_exceptions
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exceptions  # type: ignore[no-redef]
    from click.globals import get_current_context  # type: ignore[no-redef]

__all__ = ["check_listen", "click_exceptions", "command_path", "describe", "fail", "require_module"]


def command_path() -> str:
    """``kvtier <sub>`` of the running command (``kvtier`` outside one)."""
    ctx = get_current_context(silent=True)
    return ctx.command_path if ctx is not None else "kvtier"


def fail(msg: str) -> NoReturn:
    """Print ``kvtier <command>: msg`` on stderr and exit with status 2."""
    typer.echo(f"{command_path()}: {one_line(msg)}", err=True)
    raise typer.Exit(2)


def one_line(msg: str) -> str:
    return " ".join(msg.split())


def describe(exc: BaseException) -> str:
    """A one-line description of a user-caused exception (pydantic errors: ``field: message; ...``)."""
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors(include_url=False):
            loc = ".".join(str(x) for x in e["loc"])
            parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
        return "; ".join(parts)
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"no such file: {exc.filename}"
    return one_line(str(exc)) or type(exc).__name__


def check_listen(host: str, port: int) -> None:
    """Fail now, before any work, when ``host:port`` cannot be bound (busy port, unknown address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        fail(f"--listen {host}:{port}: {exc.strerror or exc}")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            s.bind(addr)
        except OSError as exc:
            fail(f"--listen {host}:{port}: cannot bind: {exc.strerror or exc}")


def require_module(module: str, extra: str, flag: str) -> None:
    """Fail before the work starts when ``flag`` needs an optional dependency that is not installed."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        fail(f"{flag} needs {module}: pip install 'kvtier[{extra}]'")
