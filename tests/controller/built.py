"""Sidecars for the controller's tests, built the way ``kvtier serve`` builds them: by the composition root
(:func:`kvtier.controller.root.build_sidecar`) from :class:`Settings`, and served by the one app factory
(:func:`kvtier.controller.app.create_app`). Nothing here wires parts by hand."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.controller.actuators.base import Actuator
from kvtier.controller.app import create_app
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.root import build_sidecar
from kvtier.controller.settings import Settings
from kvtier.controller.sidecar import Sidecar
from kvtier.policies.index import BlockIndex


def settings(state_dir: Path | str, **kw: Any) -> Settings:
    """Settings with the state in ``state_dir``, no storage collector, and the flat keys ``kw``
    (``api_token``, ``mode``, ``policy``, ``allow_active``, ``engine_urls``, ...)."""
    return Settings(**{"state_dir": str(state_dir), "storage_enabled": False, **kw})


def sidecar(
    state_dir: Path | str,
    *,
    index: BlockIndex | None = None,
    ingestor: KvIngestor | None = None,
    clock: Callable[[], float] | None = None,
    registry: CollectorRegistry | None = None,
    extra_actuators: Sequence[Actuator] = (),
    doc: PolicyDoc | None = None,
    **kw: Any,
) -> Sidecar:
    """:func:`build_sidecar` over :func:`settings` (``kw``; ``policy`` is the placement policy's name) with
    the injected parts tests need (``doc``: the seed policy document instead of the settings';
    ``extra_actuators``: built actuator objects beside the settings' ``actuators`` entries)."""
    if ingestor is None and index is not None:
        ingestor = KvIngestor(index)
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    return build_sidecar(settings(state_dir, **kw), ingestor=ingestor, registry=registry,
                         actuators=extra_actuators, policy=doc, **extra)  # fmt: skip


def client(sc: Sidecar) -> TestClient:
    """The production app around ``sc`` (lifecycle driven by the test) with a loopback ``Host``, which the
    request guard's allow-list accepts."""
    return TestClient(create_app(sc, manage_lifecycle=False), base_url="http://127.0.0.1")
