"""Figures the live tests measure on the way (hit tokens per tier, moves applied, breaker timings), kept
here and printed once after the session by ``tests/conftest.py``'s terminal summary: reporting is not a test
of its own (a test that only prints passes while everything it reports on errored)."""

from __future__ import annotations

import json
from typing import Any

FIGURES: dict[str, list[dict[str, Any]]] = {}


def record(section: str, figure: dict[str, Any]) -> None:
    """Append ``figure`` (JSON-serialisable) to ``section``; printed as ``<SECTION>_FIGURES [...]``."""
    FIGURES.setdefault(section, []).append(figure)


def lines() -> list[str]:
    return [f"{section}_FIGURES {json.dumps(figs)}" for section, figs in FIGURES.items()]
