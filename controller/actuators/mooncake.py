"""Actuator for Mooncake Store (master + clients), through the Python client and the master's admin HTTP.

Tier mapping: memory segments = ``cpu``, SSD/file replicas = ``disk``, NVMe-oF segments = ``remote``;
``Location.where`` is the segment name (the client's ``local_hostname``).

- copy: ``create_copy_task(key, [dst])``; move: ``create_move_task(key, src, dst)`` -- both polled with
  ``query_task`` to SUCCESS/FAILED or ``task_timeout_s``, then verified in the master's ``/query_key``.
  A move is the master's copy-then-free, so the last copy is never lost; kvtier checks first that the key
  has a replica at ``src`` and none only at ``dst`` (idempotent: already there -> ``skipped``).
- pin / unpin (soft): Mooncake sets pins at write time, so an existing key is pinned by re-writing its own
  bytes with ``upsert`` and ``soft_pin_action`` ENABLE / DISABLE, keeping its replica segments as the
  preferred segments. A missing key is never written (``failed``: not found).
- hard pin at write: :meth:`MooncakeActuator.write` with ``hard_pin=True``.
- evict: ``remove(key, force)``; ``-706`` (lease still held) is a ``failed`` outcome, absent = ``skipped``.

Placement checks read ``GET /query_key`` replicas' ``transport_endpoint_``, which equals the segment name
with the HTTP metadata server (not with P2PHANDSHAKE, where ports are random).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.policies.tiers import Tier

from .base import (
    ActuationResult,
    Actuator,
    AdapterHealth,
    BlockRef,
    Capability,
    KeyOutcome,
    Location,
    Outcome,
    all_keys,
)
from .resilience import CircuitOpen, HttpCaller, Resilient, TransientError

Clock = Callable[[], float]

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706


class MooncakeStore(Protocol):
    """The subset of ``mooncake.store.MooncakeDistributedStore`` the adapter uses."""

    def is_exist(self, key: str) -> int: ...
    def get(self, key: str) -> bytes: ...
    def put(self, key: str, value: bytes, config: Any = ...) -> int: ...
    def upsert(self, key: str, value: bytes, config: Any = ...) -> int: ...
    def remove(self, key: str, force: bool = ...) -> int: ...
    def create_copy_task(self, key: str, targets: list[str]) -> tuple[Any, int]: ...
    def create_move_task(self, key: str, source: str, target: str) -> tuple[Any, int]: ...
    def query_task(self, task_id: Any) -> tuple[Any, int]: ...


class MooncakeActuator(Actuator):
    """``store``: a set-up ``MooncakeDistributedStore``; ``bindings``: the ``mooncake.store`` module (for
    ``ReplicateConfig`` / ``SoftPinAction``); ``admin``: HttpCaller on the master's metrics port."""

    name = "mooncake"
    tiers = frozenset({Tier.CPU, Tier.DISK, Tier.REMOTE})

    def __init__(
        self,
        store: MooncakeStore,
        admin: HttpCaller,
        *,
        bindings: Any = None,
        resilient: Resilient | None = None,
        task_timeout_s: float = 15.0,
        poll_interval_s: float = 0.05,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bindings is None:  # pragma: no cover - needs the Mooncake wheel
            import importlib

            bindings = importlib.import_module("mooncake.store")
        self.store = store
        self.admin = admin
        self.mc = bindings
        self.resilient = resilient or Resilient(sleep=sleep)
        self.task_timeout_s = task_timeout_s
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._sleep = sleep

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(
            {
                Capability.COPY,
                Capability.MOVE,
                Capability.PIN,
                Capability.UNPIN,
                Capability.EVICT,
                Capability.HARD_PIN,
                Capability.LOOKUP,
            }
        )

    def health(self) -> AdapterHealth:
        """The worse of the client-call breaker and the master-admin breaker."""
        order = {"closed": 0, "half_open": 1, "open": 2}
        b = max((self.resilient.breaker, self.admin.resilient.breaker), key=lambda x: order[x.state])
        return AdapterHealth(self.name, b.state, b.consecutive_failures, b.last_error)

    # ---- helpers ---------------------------------------------------------------------------------
    def _client(self, fn: Callable[[], Any]) -> Any:
        """Run one client call under retry + breaker; binding exceptions count as transient."""

        def once() -> Any:
            try:
                return fn()
            except (RuntimeError, OSError) as e:
                raise TransientError(f"mooncake client: {e}") from e

        out, _ = self.resilient.call(once)
        return out

    def segments(self, key: str) -> list[str] | None:
        """Replica segments of ``key`` from the master (None = key unknown)."""
        reply, _ = self.admin.request("GET", f"/query_key?key={key}")
        body = reply.body
        if reply.status != 200 or not isinstance(body, dict) or not body.get("success"):
            return None
        return [str(d.get("transport_endpoint_")) for d in body.get("data") or [] if isinstance(d, dict)]

    def _run(
        self, action: str, blocks: Sequence[BlockRef], per_key: Callable[[str], KeyOutcome]
    ) -> ActuationResult:
        t0 = self._clock()
        a0 = self.resilient.attempts_total + self.admin.resilient.attempts_total
        res = ActuationResult(self.name, action)
        keys = list(dict.fromkeys(b.layer_key for b in blocks if b.layer_key))
        for k in keys:
            try:
                res.outcomes.append(per_key(k))
            except CircuitOpen as e:
                res.outcomes.append(KeyOutcome(k, Outcome.FAILED, f"circuit open: {e}"))
            except TransientError as e:
                res.outcomes.append(KeyOutcome(k, Outcome.FAILED, f"unreachable: {e}"))
        missing = [b for b in blocks if not b.layer_key]
        res.outcomes.extend(
            all_keys(
                ["*"] if missing else [],
                Outcome.FAILED,
                "Mooncake is key-addressed: BlockRef.layer_key needed",
            )
        )
        res.attempts = self.resilient.attempts_total + self.admin.resilient.attempts_total - a0
        res.elapsed_s = self._clock() - t0
        return res

    def _wait_task(self, task_id: Any) -> tuple[bool, str]:
        deadline = self._clock() + self.task_timeout_s
        while True:
            resp, rc = self._client(lambda: self.store.query_task(task_id))
            status = "" if resp is None else str(getattr(resp, "status", ""))
            if rc != 0:
                return False, f"query_task rc {rc}"
            if "SUCCESS" in status:
                return True, str(getattr(resp, "message", "")) or status
            if "FAILED" in status:
                return False, str(getattr(resp, "message", "")) or status
            if self._clock() >= deadline:
                return False, f"task not finished after {self.task_timeout_s} s ({status})"
            self._sleep(self.poll_interval_s)

    # ---- actions ---------------------------------------------------------------------------------
    def copy(self, blocks: Sequence[BlockRef], dst: Location) -> ActuationResult:
        def one(key: str) -> KeyOutcome:
            segs = self.segments(key)
            if not segs:
                return KeyOutcome(key, Outcome.FAILED, "key not found")
            if dst.where in segs:
                return KeyOutcome(key, Outcome.SKIPPED, f"already has a replica at {dst.where}")
            tid, rc = self._client(lambda: self.store.create_copy_task(key, [dst.where]))
            if rc != 0:
                return KeyOutcome(key, Outcome.FAILED, f"create_copy_task rc {rc}")
            ok, msg = self._wait_task(tid)
            after = self.segments(key) or []
            if ok and dst.where in after:
                return KeyOutcome(key, Outcome.APPLIED, f"replicas {sorted(after)}")
            return KeyOutcome(key, Outcome.FAILED, f"{msg}; replicas {sorted(after)}")

        return self._run("copy", blocks, one)

    def move(self, blocks: Sequence[BlockRef], src: Location, dst: Location) -> ActuationResult:
        def one(key: str) -> KeyOutcome:
            segs = self.segments(key)
            if not segs:
                return KeyOutcome(key, Outcome.FAILED, "key not found")
            if src.where not in segs:
                if dst.where in segs:
                    return KeyOutcome(key, Outcome.SKIPPED, f"already at {dst.where}")
                return KeyOutcome(key, Outcome.FAILED, f"no replica at {src.where} (replicas {segs})")
            tid, rc = self._client(lambda: self.store.create_move_task(key, src.where, dst.where))
            if rc != 0:
                return KeyOutcome(key, Outcome.FAILED, f"create_move_task rc {rc}")
            ok, msg = self._wait_task(tid)
            after = self.segments(key) or []
            if ok and dst.where in after:
                return KeyOutcome(key, Outcome.APPLIED, f"replicas {sorted(after)}")
            return KeyOutcome(key, Outcome.FAILED, f"{msg}; replicas {sorted(after)}")

        return self._run("move", blocks, one)

    def _rewrite(
        self, key: str, action: str, *, ttl_s: float | None = None, hard: bool = False
    ) -> KeyOutcome:
        segs = self.segments(key)
        if not segs:
            return KeyOutcome(key, Outcome.FAILED, "key not found")
        value = self._client(lambda: self.store.get(key))
        if not value:
            return KeyOutcome(key, Outcome.FAILED, "key not readable; not rewritten")
        cfg = self.mc.ReplicateConfig()
        cfg.preferred_segments = list(dict.fromkeys(segs))
        cfg.replica_num = len(cfg.preferred_segments)
        if hard:
            cfg.with_hard_pin = True
        spa = self.mc.SoftPinAction
        cfg.soft_pin_action = spa.ENABLE if action == "pin" else spa.DISABLE
        if ttl_s is not None:
            cfg.soft_pin_ttl_ms = int(ttl_s * 1000)
        rc = self._client(lambda: self.store.upsert(key, value, cfg))
        if rc != 0:
            # never lose the block: if the failed rewrite dropped the key, put the bytes we hold back
            if not self.segments(key):
                back = self.mc.ReplicateConfig()
                back.preferred_segments = cfg.preferred_segments
                rc2 = self._client(lambda: self.store.put(key, value, back))
                return KeyOutcome(key, Outcome.FAILED, f"upsert rc {rc}; key restored (put rc {rc2})")
            return KeyOutcome(key, Outcome.FAILED, f"upsert rc {rc}")
        return KeyOutcome(key, Outcome.APPLIED, f"upsert soft_pin {action}; replicas {sorted(segs)}")

    def pin(
        self, blocks: Sequence[BlockRef], tier: Tier = Tier.CPU, ttl_s: float | None = None
    ) -> ActuationResult:
        return self._run("pin", blocks, lambda k: self._rewrite(k, "pin", ttl_s=ttl_s))

    def unpin(self, blocks: Sequence[BlockRef], tier: Tier = Tier.CPU) -> ActuationResult:
        return self._run("unpin", blocks, lambda k: self._rewrite(k, "unpin"))

    def write(
        self,
        key: str,
        value: bytes,
        *,
        hard_pin: bool = False,
        soft_pin_ttl_s: float | None = None,
        segment: str | None = None,
    ) -> ActuationResult:
        """Put ``value`` under ``key`` with a hard pin and/or a soft pin (pins are set at write time)."""

        def one(k: str) -> KeyOutcome:
            cfg = self.mc.ReplicateConfig()
            cfg.with_hard_pin = hard_pin
            if soft_pin_ttl_s is not None:
                cfg.soft_pin_action = self.mc.SoftPinAction.ENABLE
                cfg.soft_pin_ttl_ms = int(soft_pin_ttl_s * 1000)
            if segment:
                cfg.preferred_segment = segment
            rc = self._client(lambda: self.store.put(k, value, cfg))
            return KeyOutcome(k, Outcome.APPLIED if rc == 0 else Outcome.FAILED, f"put rc {rc}")

        return self._run("hard_pin" if hard_pin else "write", [BlockRef(layer_key=key)], one)

    def evict(
        self, blocks: Sequence[BlockRef], tier: Tier | None = None, *, force: bool = False
    ) -> ActuationResult:
        def one(key: str) -> KeyOutcome:
            # no is_exist() first: an existence check grants the caller a lease and would block the remove
            rc = self._client(lambda: self.store.remove(key, force))
            if rc == 0:
                return KeyOutcome(key, Outcome.APPLIED, "removed")
            if rc == OBJECT_NOT_FOUND:
                return KeyOutcome(key, Outcome.SKIPPED, "not present")
            why = "object has a lease" if rc == OBJECT_HAS_LEASE else "remove failed"
            return KeyOutcome(key, Outcome.FAILED, f"{why} (rc {rc})")

        return self._run("evict", blocks, one)

    def lookup(self, blocks: Sequence[BlockRef]) -> ActuationResult:
        def one(key: str) -> KeyOutcome:
            segs = self.segments(key)
            if not segs:
                return KeyOutcome(key, Outcome.SKIPPED, "not present")
            return KeyOutcome(key, Outcome.APPLIED, ",".join(sorted(segs)))

        return self._run("lookup", blocks, one)

    def close(self) -> None:
        self.admin.close()
