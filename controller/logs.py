"""Structured logs: ``--log-json`` / ``KVTIER_LOG_JSON`` switches to one JSON object per line.

uvicorn's own loggers (server and access log) go through the same handler, so ``--log-json`` covers them
too; the access log leaves out the scrape and probe endpoints (``/metrics``, ``/healthz``, ``/readyz``:
one line per second per scraper otherwise). Records made inside a span carry ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kvtier.controller.tracing import current_trace_ids

_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
QUIET_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``; ``exc`` holds a formatted traceback when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v if isinstance(v, str | int | float | bool | None) else repr(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TraceIdFilter(logging.Filter):
    """Adds ``trace_id``/``span_id`` (hex) to a record made inside a sampled span."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = current_trace_ids()
        if ids is not None and not hasattr(record, "trace_id"):
            record.trace_id, record.span_id = ids
        return True


class QuietPathsFilter(logging.Filter):
    """Drops uvicorn access-log records of the scrape and probe endpoints."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0].rstrip("/") not in QUIET_PATHS
        return True


def configure_logging(level: str = "INFO", *, json_lines: bool = False) -> None:
    """One stderr handler on the root logger for kvtier, its libraries and uvicorn.

    Run uvicorn with ``log_config=None`` so it keeps these handlers instead of installing its own."""
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(TraceIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPathsFilter) for f in access.filters):
        access.addFilter(QuietPathsFilter())
    # one INFO line per peer request (scrapes every second, actuations) drowns the sidecar's own logs;
    # they stay available at DEBUG
    quiet = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(quiet)
