"""The control plane at run time: the reconcile loop's task, the periodic retrain, the API context and the
state store (:class:`ControlPlane`), and the ingestor's sink that feeds it (:class:`ControlSink`).

Both are built by the composition root (:func:`kvtier.controller.root.build_sidecar`). The collectors own the
index and feed it from KV events; :class:`ControlSink` hands each batch on to the placement policy's request
inference and, for ``BlockStored`` events, to the token store used by warm-ups; then it wakes the loop
(events never carry state into the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI

from kvtier.collectors.vllm_events import BlockStored, DecodedBatch, block_key
from kvtier.controller.api import ControlContext, add_control_routes
from kvtier.controller.loop import ReconcileLoop
from kvtier.controller.model import ModelManager
from kvtier.controller.store import StateStore

log = logging.getLogger(__name__)


@dataclass
class ControlPlane:
    loop: ReconcileLoop
    ctx: ControlContext
    store: StateStore
    _task: asyncio.Task[None] | None = None
    _retrain_task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def on_block_stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> None:
        """Feed a ``BlockStored`` event's tokens (for warm-ups) and wake the loop."""
        self.loop.tokens.on_block_stored(hashes, parent, token_ids, block_size)
        self.loop.wake()

    def mount(self, app: FastAPI) -> None:
        """The policy API (``/v1/policy``, ``/v1/pins``, ...) and its request guard on ``app``."""
        add_control_routes(app, self.ctx)

    async def start(self) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.loop.run(self._stop))
        self._retrain_task = asyncio.create_task(self._retrain_periodically())

    async def _retrain_periodically(self) -> None:
        """Retrain every ``predictor.retrain_interval_s`` (0 = only on ``POST /v1/model/retrain``)."""
        while not self._stop.is_set():
            every = self.loop.policy.predictor.retrain_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=every if every > 0 else 60.0)
            if self._stop.is_set() or every <= 0:
                continue
            try:
                await asyncio.to_thread(self.ctx.models.retrain)
            except ModelManager.NotTrainable as exc:
                log.info("periodic retrain skipped: %s", exc)
            except Exception:  # noqa: BLE001 - keep serving with the current model
                log.exception("periodic retrain failed")

    async def stop(self) -> None:
        self._stop.set()
        if self._retrain_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._retrain_task, timeout=5)
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=self.loop.policy.tick_timeout_s + 5)
        for a in self.loop.actuators:
            with contextlib.suppress(Exception):
                a.close()
        self.store.close()


class ControlSink:
    """The control plane's :class:`~kvtier.collectors.kv_ingest.BatchSink`: block tokens, requests for the
    placement policy, a loop wake-up after each batch."""

    feed_per_batch = 16  # requests served through the placement policy per batch (~0.4 ms each, learned)

    def __init__(
        self,
        plane: ControlPlane,
        on_stored: Callable[[int | None, Sequence[int], int], None] | None = None,
    ) -> None:
        """``on_stored``: also fed (parent, block hashes, block size) of every ``BlockStored`` (the L1
        keeper's hook)."""
        self.plane = plane
        self.on_stored = on_stored

    def on_batch(self, engine: str, batch: DecodedBatch) -> None:
        plane = self.plane
        pl = plane.loop.placement
        if pl is not None:  # request-shaped accesses for the placement policy
            try:
                pl.requests.on_events(batch.events)
            except Exception as exc:  # noqa: BLE001 - a bad event must not stop ingestion
                pl.requests.counts["skipped_events"] += 1
                log.warning("request inference: skipped a batch: %s", exc)
            try:  # serve them now, off the tick's path (bounded; skipped while a tick holds the policy)
                pl.feed(self.feed_per_batch)
            except Exception as exc:  # noqa: BLE001 - a policy bug must not stop ingestion
                pl.errors += 1
                log.warning("placement policy: feeding failed: %s", exc)
        tokens = plane.loop.tokens
        for e in batch.events:
            if type(e) is BlockStored and e.block_size > 0:
                try:
                    toks = e.tokens()
                    parent = None if e.parent_block_hash is None else block_key(e.parent_block_hash)
                    keys = [block_key(h) for h in e.block_hashes]
                    tokens.on_block_stored(keys, parent, toks, e.block_size)
                    if self.on_stored is not None:
                        self.on_stored(parent, keys, e.block_size)
                except Exception as exc:  # noqa: BLE001 - a bad event must not stop ingestion
                    log.warning("token store: skipped a BlockStored event: %s", exc)
        plane.loop.wake()
