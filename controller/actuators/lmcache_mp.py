"""Actuator for LMCache's multiprocess (MP) server -- the seed stack (vLLM + LMCacheMPConnector).

Tier mapping: LMCache L1 (host DRAM) = ``cpu``, L2 (``fs`` adapter) = ``disk``.

- promote / prefetch (``disk`` -> ``cpu``): ``POST /cache/prefetches`` by token ids, polled with
  ``GET /cache/prefetches/{id}`` until ``completed`` or ``prefetch_timeout_s``.
- demote (``cpu`` -> ``disk``): copy, verify, free. LMCache writes L2 copies itself (store policy), so
  "copy" is the server's; kvtier *verifies* the L2 copy of each key (the ``fs`` file exists) and only then
  sends ``DELETE /cache/objects`` tier ``l1`` for that key. Unverified keys are ``skipped`` -- never the last
  copy deleted.
- evict: ``DELETE /cache/objects`` tier ``all`` (or ``l2`` for ``disk``; ``cpu`` = demote's safe path).
- clear: ``POST /cache/clear`` tier ``l1``. quota: ``PUT|DELETE /quota/{cache_salt}`` (GiB on the wire).
- pin / unpin are **emulated** (LMCache MP has no pin): ``pin`` promotes the prefix to L1 now and remembers
  it; :meth:`LMCacheMPActuator.refresh_pins` (the loop calls it every tick) re-promotes every pinned prefix,
  so one that L1 evicted under pressure is loaded back from its L2 copy; ``unpin`` forgets it.

Keys are computed client-side (:mod:`.lmcache_keys`); one DELETE per key so outcomes are exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
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
from .lmcache_keys import ObjectKey, kv_rank, object_keys
from .resilience import CircuitOpen, HttpCaller, HttpReply, TransientError

Clock = Callable[[], float]


class L2Verifier(Protocol):
    """Does LMCache's L2 hold a copy of this key?"""

    def has_copy(self, key: ObjectKey) -> bool: ...


class FsL2Verifier:
    """Checks the ``fs`` L2 adapter's file for a key (the MP server is node-local, so is kvtier)."""

    def __init__(self, base_path: str | Path) -> None:
        self.base_path = Path(base_path)

    def has_copy(self, key: ObjectKey) -> bool:
        p = self.base_path / key.fs_filename()
        try:
            return p.is_file() and p.stat().st_size > 0
        except OSError:
            return False

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> FsL2Verifier | None:
        """The first local ``FSL2Adapter`` listed in ``GET /status``, or None."""
        adapters = (status.get("storage_manager") or {}).get("l2_adapters") or []
        for a in adapters:
            if (
                isinstance(a, dict)
                and a.get("type") == "FSL2Adapter"
                and a.get("base_path")
                and Path(str(a["base_path"])).is_dir()
            ):
                return cls(str(a["base_path"]))
        return None


_TIER_WIRE = {Tier.CPU: "l1", Tier.DISK: "l2"}


def _label(key: ObjectKey, world_size: int) -> str:
    return key.chunk_hash_hex if world_size == 1 else f"{key.chunk_hash_hex}@{key.kv_rank:#010x}"


class LMCacheMPActuator(Actuator):
    """Adapter for one LMCache MP server's HTTP API (``base_url`` = its ``--http-host/--http-port``)."""

    name = "lmcache-mp"
    token_addressed = True  # one ref's keys are the chunks of its prefix, not its layer_key
    tiers = frozenset({Tier.CPU, Tier.DISK})  # L1 (DRAM) and L2 (fs)
    refreshes_pins = True  # pins are emulated by re-prefetching (refresh_pins)

    def __init__(
        self,
        caller: HttpCaller,
        *,
        world_size: int = 1,
        chunk_size: int | None = None,
        l2_verifier: L2Verifier | None = None,
        discover_verifier: bool = True,
        prefetch_timeout_s: float = 10.0,
        poll_interval_s: float = 0.01,
        model_name: str = "",
        clock: Clock = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``model_name``: LMCache's model name (vLLM's ``--model`` path) used instead of ``BlockRef.model``
        when set (the loop's refs carry the served name)."""
        self.caller = caller
        self.model_name = model_name
        self.world_size = world_size
        self._chunk_size = chunk_size
        self._verifier = l2_verifier
        self._discover = discover_verifier and l2_verifier is None
        self.prefetch_timeout_s = prefetch_timeout_s
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._sleep = sleep
        self._pins: dict[tuple[str, str, tuple[int, ...]], BlockRef] = {}
        self._pins_lock = threading.Lock()

    # ---- discovery -------------------------------------------------------------------------------
    def server_status(self) -> dict[str, Any]:
        """The MP server's ``GET /status`` body (chunk size, L1/L2 managers' object counts); raises
        TransientError when it does not answer 200 with an object. Goes through this adapter's breaker."""
        reply, _ = self.caller.request("GET", "/status")
        if reply.status != 200 or not isinstance(reply.body, dict):
            raise TransientError(f"GET /status -> {reply.status}")
        return reply.body

    def chunk_size(self) -> int:
        """Tokens per LMCache chunk (from ``/status`` unless given)."""
        if self._chunk_size is None:
            self._chunk_size = int(self.server_status()["chunk_size"])
        return self._chunk_size

    def verifier(self) -> L2Verifier | None:
        if self._verifier is None and self._discover:
            self._verifier = FsL2Verifier.from_status(self.server_status())
            self._discover = False
        return self._verifier

    def capabilities(self) -> frozenset[Capability]:
        caps = {
            Capability.PROMOTE,
            Capability.PREFETCH,
            Capability.EVICT,
            Capability.CLEAR,
            Capability.QUOTA,
            Capability.DEMOTE,
            Capability.PIN,
            Capability.UNPIN,
        }
        return frozenset(caps)

    def health(self) -> AdapterHealth:
        b = self.caller.resilient.breaker
        return AdapterHealth(self.name, b.state, b.consecutive_failures, b.last_error)

    # ---- keys ------------------------------------------------------------------------------------
    def _model(self, ref: BlockRef) -> str:
        return self.model_name or ref.model

    def keys_for(self, ref: BlockRef) -> list[ObjectKey]:
        """Object keys a ref addresses: every full chunk of its prefix, or its one ``layer_key``."""
        ranks = None if ref.rank is None else [ref.rank]
        model = self._model(ref)
        if ref.token_ids:
            return object_keys(
                model,
                ref.token_ids,
                self.chunk_size(),
                cache_salt=ref.cache_salt,
                world_size=self.world_size,
                ranks=ranks,
            )
        if ref.layer_key:
            rs = range(self.world_size) if ref.rank is None else [ref.rank]
            return [
                ObjectKey(ref.layer_key, model, kv_rank(self.world_size, r), 0, ref.cache_salt) for r in rs
            ]
        return []

    def _expand(self, blocks: Sequence[BlockRef]) -> list[ObjectKey]:
        seen: dict[tuple[str, str, int, str], ObjectKey] = {}
        for ref in blocks:
            for k in self.keys_for(ref):
                seen.setdefault((k.chunk_hash_hex, k.model_name, k.kv_rank, k.cache_salt), k)
        return list(seen.values())

    # ---- calls -----------------------------------------------------------------------------------
    def _call(self, res: ActuationResult, method: str, path: str, body: Any = None) -> HttpReply:
        reply, _ = self.caller.request(method, path, body)
        return reply

    def _guarded(
        self,
        action: str,
        blocks: Sequence[BlockRef],
        body: Callable[[ActuationResult, list[ObjectKey]], None],
    ) -> ActuationResult:
        t0 = self._clock()
        a0 = self.caller.resilient.attempts_total
        res = ActuationResult(self.name, action)
        keys: list[ObjectKey] = []
        try:
            keys = self._expand(blocks)
            body(res, keys)
        except CircuitOpen as e:
            self._fail_rest(res, keys, f"circuit open: {e}")
        except TransientError as e:
            self._fail_rest(res, keys, f"unreachable: {e}")
        res.attempts = self.caller.resilient.attempts_total - a0
        res.elapsed_s = self._clock() - t0
        return res

    def _fail_rest(self, res: ActuationResult, keys: list[ObjectKey], detail: str) -> None:
        done = {o.key for o in res.outcomes}
        labels = [_label(k, self.world_size) for k in keys] or ["*"]
        res.outcomes.extend(all_keys([lb for lb in labels if lb not in done], Outcome.FAILED, detail))

    def _delete(self, res: ActuationResult, key: ObjectKey, tier: str) -> KeyOutcome:
        reply = self._call(res, "DELETE", "/cache/objects", {"keys": [key.encoded()], "tier": tier})
        label = _label(key, self.world_size)
        if reply.status != 200 or not isinstance(reply.body, dict):
            return KeyOutcome(label, Outcome.FAILED, f"HTTP {reply.status}: {_detail(reply)}")
        n = int(reply.body.get("deleted", 0))
        if n > 0:
            return KeyOutcome(label, Outcome.APPLIED, f"deleted {n} from {tier}")
        return KeyOutcome(label, Outcome.SKIPPED, f"not present in {tier}")

    def promote(self, blocks: Sequence[BlockRef], to: Tier = Tier.CPU) -> ActuationResult:
        return self._prefetch("promote", blocks, to)

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier = Tier.CPU) -> ActuationResult:
        return self._prefetch("prefetch", blocks, to)

    def _prefetch(self, action: str, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        def run(res: ActuationResult, keys: list[ObjectKey]) -> None:
            if to is not Tier.CPU:
                res.outcomes.extend(
                    all_keys(
                        [_label(k, self.world_size) for k in keys],
                        Outcome.FAILED,
                        f"LMCache MP only loads disk (l2) -> cpu (l1), not -> {to}",
                    )
                )
                return
            for ref in blocks:
                ref_keys = self.keys_for(ref)
                labels = [_label(k, self.world_size) for k in ref_keys]
                if not ref.token_ids:
                    res.outcomes.extend(
                        all_keys(
                            labels or [ref.layer_key],
                            Outcome.FAILED,
                            "prefetch is token-addressed: BlockRef.token_ids needed",
                        )
                    )
                    continue
                if not ref_keys:
                    res.outcomes.append(
                        KeyOutcome(ref.layer_key or "*", Outcome.SKIPPED, "shorter than one chunk")
                    )
                    continue
                res.outcomes.extend(self._prefetch_one(res, ref, ref_keys, labels))

        return self._guarded(action, blocks, run)

    def _prefetch_one(
        self, res: ActuationResult, ref: BlockRef, keys: list[ObjectKey], labels: list[str]
    ) -> list[KeyOutcome]:
        body = {
            "model_name": self._model(ref),
            "world_size": self.world_size,
            "token_ids": list(ref.token_ids or ()),
            "cache_salt": ref.cache_salt,
            "source_tier": "l2",
            "target_tier": "l1",
        }
        reply = self._call(res, "POST", "/cache/prefetches", body)
        if reply.status != 202 or not isinstance(reply.body, dict):
            return all_keys(labels, Outcome.FAILED, f"HTTP {reply.status}: {_detail(reply)}")
        if reply.body.get("status") == "noop":
            return all_keys(labels, Outcome.SKIPPED, "noop")
        rid = str(reply.body.get("request_id"))
        res.handle = rid
        deadline = self._clock() + self.prefetch_timeout_s
        while True:
            st = self._call(res, "GET", f"/cache/prefetches/{rid}")
            if st.status == 200 and isinstance(st.body, dict) and st.body.get("status") == "completed":
                break
            if st.status != 200:
                return all_keys(labels, Outcome.FAILED, f"poll HTTP {st.status}: {_detail(st)}")
            if self._clock() >= deadline:
                return all_keys(
                    labels, Outcome.FAILED, f"prefetch {rid} not completed in {self.prefetch_timeout_s} s"
                )
            self._sleep(self.poll_interval_s)
        found, total = int(st.body.get("found_keys", 0)), int(st.body.get("total_keys", 0))
        detail = f"prefetch {rid}: found {found}/{total} in l2"
        if total and found >= total:
            return all_keys(labels, Outcome.APPLIED, detail)
        v = self.verifier()
        if v is None:
            return all_keys(labels, Outcome.FAILED, detail + " (no per-key L2 view)")
        return [
            KeyOutcome(
                lb,
                Outcome.APPLIED if v.has_copy(k) else Outcome.FAILED,
                detail if v.has_copy(k) else detail + "; key not in l2",
            )
            for k, lb in zip(keys, labels, strict=True)
        ]

    # ---- emulated pins ---------------------------------------------------------------------------
    @staticmethod
    def _pin_key(ref: BlockRef) -> tuple[str, str, tuple[int, ...]]:
        return (ref.model, ref.cache_salt, tuple(ref.token_ids or ()))

    def pinned(self) -> list[BlockRef]:
        with self._pins_lock:
            return list(self._pins.values())

    def pin(
        self, blocks: Sequence[BlockRef], tier: Tier = Tier.CPU, ttl_s: float | None = None
    ) -> ActuationResult:
        """Keep prefixes in L1 (``cpu``): promote now and on every :meth:`refresh_pins`. ``ttl_s`` is
        ignored (the pin lasts until :meth:`unpin`)."""
        if tier is not Tier.CPU:
            res = ActuationResult(self.name, "pin")
            res.outcomes.append(
                KeyOutcome("*", Outcome.FAILED, f"LMCache MP pins (emulated) to cpu only, not {tier}")
            )
            return res
        refs = [b for b in blocks if b.token_ids]
        with self._pins_lock:
            for b in refs:
                self._pins[self._pin_key(b)] = b
        res = self._prefetch("pin", blocks, Tier.CPU)
        return res

    def unpin(self, blocks: Sequence[BlockRef], tier: Tier = Tier.CPU) -> ActuationResult:
        res = ActuationResult(self.name, "unpin")
        with self._pins_lock:
            for b in blocks:
                gone = self._pins.pop(self._pin_key(b), None)
                res.outcomes.append(
                    KeyOutcome(
                        b.layer_key or f"tokens:{len(b.token_ids or ())}",
                        Outcome.APPLIED if gone else Outcome.SKIPPED,
                        "unpinned" if gone else "was not pinned",
                    )
                )
        return res

    def refresh_pins(self) -> ActuationResult:
        """Re-promote every pinned prefix (idempotent: chunks already in L1 stay; evicted ones reload).
        A pinned prefix of another pinned prefix is covered by the longer one's prefetch."""
        refs = sorted(self.pinned(), key=lambda b: -len(b.token_ids or ()))
        kept: list[BlockRef] = []
        for b in refs:
            t = b.token_ids or ()
            if not any(
                k.model == b.model and k.cache_salt == b.cache_salt and (k.token_ids or ())[: len(t)] == t
                for k in kept
            ):
                kept.append(b)
        return self._prefetch("pin_refresh", kept, Tier.CPU)

    def demote(self, blocks: Sequence[BlockRef], to: Tier = Tier.DISK) -> ActuationResult:
        def run(res: ActuationResult, keys: list[ObjectKey]) -> None:
            if to is not Tier.DISK:
                res.outcomes.extend(
                    all_keys(
                        [_label(k, self.world_size) for k in keys],
                        Outcome.FAILED,
                        f"LMCache MP demotes cpu (l1) -> disk (l2) only, not -> {to}",
                    )
                )
                return
            self._safe_l1_free(res, keys)

        return self._guarded("demote", blocks, run)

    def _safe_l1_free(self, res: ActuationResult, keys: list[ObjectKey]) -> None:
        v = self.verifier()
        for k in keys:
            if v is None or not v.has_copy(k):
                why = "no L2 view to verify the copy" if v is None else "no L2 copy"
                res.outcomes.append(
                    KeyOutcome(
                        _label(k, self.world_size),
                        Outcome.SKIPPED,
                        f"{why}; refusing to delete the last copy",
                    )
                )
                continue
            res.outcomes.append(self._delete(res, k, "l1"))

    def evict(self, blocks: Sequence[BlockRef], tier: Tier | None = None) -> ActuationResult:
        def run(res: ActuationResult, keys: list[ObjectKey]) -> None:
            if tier is Tier.CPU:
                self._safe_l1_free(res, keys)
                return
            wire = "all" if tier is None else _TIER_WIRE.get(tier)
            if wire is None:
                res.outcomes.extend(
                    all_keys(
                        [_label(k, self.world_size) for k in keys],
                        Outcome.FAILED,
                        f"LMCache MP has no tier {tier}",
                    )
                )
                return
            for k in keys:
                res.outcomes.append(self._delete(res, k, wire))

        return self._guarded("evict", blocks, run)

    def clear(self, where: Location) -> ActuationResult:
        def run(res: ActuationResult, keys: list[ObjectKey]) -> None:
            if where.tier is not Tier.CPU:
                res.outcomes.append(KeyOutcome("l1", Outcome.FAILED, "LMCache MP clears l1 (cpu) only"))
                return
            reply = self._call(res, "POST", "/cache/clear", {"tier": "l1", "force": False})
            ok = reply.status == 200
            res.outcomes.append(
                KeyOutcome(
                    "l1",
                    Outcome.APPLIED if ok else Outcome.FAILED,
                    "" if ok else f"HTTP {reply.status}: {_detail(reply)}",
                )
            )

        return self._guarded("clear", [], run)

    def set_quota(self, cache_salt: str, limit_bytes: int | None) -> ActuationResult:
        def run(res: ActuationResult, keys: list[ObjectKey]) -> None:
            path = f"/quota/{cache_salt}"
            if limit_bytes is None:
                reply = self._call(res, "DELETE", path)
            else:
                reply = self._call(res, "PUT", path, {"limit_gb": limit_bytes / float(1 << 30)})
            ok = reply.status == 200
            res.outcomes.append(
                KeyOutcome(
                    cache_salt,
                    Outcome.APPLIED if ok else Outcome.FAILED,
                    "" if ok else f"HTTP {reply.status}: {_detail(reply)}",
                )
            )

        return self._guarded("quota", [], run)

    def get_quota(self, cache_salt: str) -> dict[str, Any]:
        reply, _ = self.caller.request("GET", f"/quota/{cache_salt}")
        return reply.body if isinstance(reply.body, dict) else {}

    def close(self) -> None:
        self.caller.close()


def _detail(reply: HttpReply) -> str:
    if isinstance(reply.body, dict):
        return str(reply.body.get("detail") or reply.body.get("error") or reply.body)[:300]
    return str(reply.body)[:300]


def build(base_url: str, **kw: Any) -> LMCacheMPActuator:
    """Default wiring: httpx client with a 5 s timeout, 3 attempts, breaker opening after 3 failures."""
    return LMCacheMPActuator(HttpCaller(base_url, timeout_s=kw.pop("timeout_s", 5.0)), **kw)
