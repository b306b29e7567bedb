"""uvicorn's h11 protocol with a request deadline: a connection that has not delivered a whole request
(headers and body) within ``deadline_s`` is closed.

Why: uvicorn times out *idle* keep-alive connections, but not a connection that sent half a request line, a
few headers, or announced a body it never sends ("slowloris"): thousands of those stay open forever and hold
file descriptors and memory. The deadline is re-armed after every response, so long-lived keep-alive clients
are unaffected; a request whose body has arrived is never cut, however long its handler runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol + :attr:`deadline_s` (seconds) to receive each request; :attr:`expired` counts closes."""

    deadline_s = 15.0
    expired = 0  # connections closed for missing the deadline, whole process

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.deadline_s, self._expire)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _expire(self) -> None:
        self._deadline = None
        c = self.cycle
        # no request yet, a body still arriving, or between requests (a partial next request / idle)
        waiting = c is None or c.more_body or c.response_complete
        if waiting and not self.transport.is_closing():
            type(self).expired += 1
            self.transport.close()


def deadline_protocol(deadline_s: float) -> type[DeadlineH11Protocol]:
    """A protocol class with its own deadline (uvicorn takes a class, not an instance)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"deadline_s": deadline_s, "expired": 0})
