"""Run a real kvtier sidecar in a background thread: ``build_sidecar`` + ``create_app`` as ``kvtier serve``
does, on uvicorn on a free 127.0.0.1 port, its state in a temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from kvtier.controller.app import create_app
from kvtier.controller.root import build_sidecar
from kvtier.controller.settings import Settings
from kvtier.controller.sidecar import Sidecar
from tests.peers.vllm import free_port


class SidecarThread:
    """``start()`` -> serving on ``url``; ``stop()`` ends the loops, the server and the thread."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self._state = tempfile.TemporaryDirectory(prefix="kvtier-sidecar-")
        serve = {"listen": f"127.0.0.1:{self.port}", "state_dir": self._state.name}
        self.settings = settings.model_copy(update={"serve": settings.serve.model_copy(update=serve)})
        self.sidecar: Sidecar | None = None
        self._server: uvicorn.Server | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvtier-sidecar")
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()/stop()
            self._error = exc

    async def _main(self) -> None:
        self.sidecar = build_sidecar(self.settings)
        cfg = uvicorn.Config(create_app(self.sidecar), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(cfg)
        await self._server.serve()

    def start(self, timeout_s: float = 30.0) -> SidecarThread:
        self._thread.start()
        wait_for(lambda: self._server is not None and self._server.started, timeout_s, "sidecar API up",
                 lambda: self._error)  # fmt: skip
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=30)
        self._state.cleanup()

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10.0)

    def status(self) -> dict[str, Any]:
        r = self.get("/v1/status")
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


def wait_for(cond: Any, timeout_s: float, what: str, error: Any = None, interval_s: float = 0.2) -> Any:
    """Poll ``cond()`` until truthy and return its value; TimeoutError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if error is not None and (e := error()) is not None:
            raise RuntimeError(f"while waiting for {what}: {e!r}")
        with contextlib.suppress(httpx.HTTPError):
            last = cond()
            if last:
                return last
        time.sleep(interval_s)  # polling interval of a condition with a deadline
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what} (last={last!r})")


@contextlib.contextmanager
def running(settings: Settings) -> Iterator[SidecarThread]:
    sc = SidecarThread(settings).start()
    try:
        yield sc
    finally:
        sc.stop()
