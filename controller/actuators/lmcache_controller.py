"""Actuator for LMCache's legacy cache controller (``lmcache_controller``; LMCacheConnectorV1 deployments).

Token-addressed: a :class:`BlockRef` needs ``token_ids`` (the controller hashes them with its own chunking).
Locations are LMCache backend names: ``cpu`` -> ``LocalCPUBackend``, ``disk`` -> ``LocalDiskBackend``,
``remote`` -> ``RemoteBackend``; ``Location.where`` is the worker ``instance_id``.

- pin: ``POST /pin`` (expires after the worker's ``pin_timeout_sec``; there is no unpin endpoint, and no
  per-call TTL -- ``ttl_s`` is ignored and says so in the detail). ``num_tokens`` 0 = ``skipped``.
- lookup: ``POST /lookup``; clear: ``POST /clear`` (a whole tier of one instance, not per key).
- move / copy: ``POST /move`` (``should_copy``). LMCache only implements cross-node moves to
  ``LocalCPUBackend`` with P2P enabled; otherwise the controller answers 500 and the outcome is ``failed``
  with its reason. A move is the worker's copy-then-free.
The controller reports errors as HTTP 500 + ``detail``: those are refusals, not retried.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

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
)
from .resilience import CircuitOpen, HttpCaller, HttpReply, Resilient, TransientError

Clock = Callable[[], float]

LOCATIONS = {Tier.CPU: "LocalCPUBackend", Tier.DISK: "LocalDiskBackend", Tier.REMOTE: "RemoteBackend"}


def ref_label(ref: BlockRef) -> str:
    """Outcome key for a token-addressed ref: its layer_key, else ``tokens:<n>:<sha1 prefix>``."""
    if ref.layer_key:
        return ref.layer_key
    toks = ref.token_ids or ()
    digest = hashlib.sha1(",".join(map(str, toks)).encode()).hexdigest()[:12]
    return f"tokens:{len(toks)}:{digest}"


class LMCacheControllerActuator(Actuator):
    """``caller``: HttpCaller on the controller's HTTP port; ``instance_id``: the default worker instance."""

    name = "lmcache-controller"
    tiers = frozenset({Tier.CPU, Tier.DISK})

    def __init__(self, caller: HttpCaller, *, instance_id: str, clock: Clock = time.monotonic) -> None:
        self.caller = caller
        self.instance_id = instance_id
        self._clock = clock

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(
            {Capability.PIN, Capability.LOOKUP, Capability.CLEAR, Capability.MOVE, Capability.COPY}
        )

    def health(self) -> AdapterHealth:
        b = self.caller.resilient.breaker
        return AdapterHealth(self.name, b.state, b.consecutive_failures, b.last_error)

    def _post(self, res: ActuationResult, path: str, body: dict[str, Any]) -> HttpReply:
        reply, attempts = self.caller.request("POST", path, body)
        res.attempts += attempts
        return reply

    def _each(
        self, action: str, blocks: Sequence[BlockRef], one: Callable[[ActuationResult, BlockRef], KeyOutcome]
    ) -> ActuationResult:
        t0 = self._clock()
        a0 = self.caller.resilient.attempts_total
        res = ActuationResult(self.name, action)
        for ref in blocks:
            label = ref_label(ref)
            if not ref.token_ids:
                res.outcomes.append(KeyOutcome(label, Outcome.FAILED, "token_ids needed (token-addressed)"))
                continue
            try:
                res.outcomes.append(one(res, ref))
            except CircuitOpen as e:
                res.outcomes.append(KeyOutcome(label, Outcome.FAILED, f"circuit open: {e}"))
            except TransientError as e:
                res.outcomes.append(KeyOutcome(label, Outcome.FAILED, f"unreachable: {e}"))
        res.attempts = self.caller.resilient.attempts_total - a0
        res.elapsed_s = self._clock() - t0
        return res

    @staticmethod
    def _refused(reply: HttpReply) -> str:
        d = reply.body.get("detail") if isinstance(reply.body, dict) else reply.body
        return f"HTTP {reply.status}: {str(d)[:300]}"

    def pin(
        self, blocks: Sequence[BlockRef], tier: Tier = Tier.CPU, ttl_s: float | None = None
    ) -> ActuationResult:
        loc = LOCATIONS[tier]
        note = "" if ttl_s is None else "; ttl_s ignored (worker pin_timeout_sec applies)"

        def one(res: ActuationResult, ref: BlockRef) -> KeyOutcome:
            reply = self._post(
                res,
                "/pin",
                {"instance_id": self.instance_id, "location": loc, "tokens": list(ref.token_ids or ())},
            )
            if reply.status != 200 or not isinstance(reply.body, dict):
                return KeyOutcome(ref_label(ref), Outcome.FAILED, self._refused(reply))
            n = int(reply.body.get("num_tokens", 0))
            out = Outcome.APPLIED if n > 0 else Outcome.SKIPPED
            why = f"pinned {n} tokens at {loc}" if n > 0 else f"nothing cached at {loc} to pin"
            return KeyOutcome(ref_label(ref), out, why + note)

        return self._each("pin", blocks, one)

    def lookup(self, blocks: Sequence[BlockRef]) -> ActuationResult:
        def one(res: ActuationResult, ref: BlockRef) -> KeyOutcome:
            reply = self._post(res, "/lookup", {"tokens": list(ref.token_ids or ())})
            if reply.status != 200 or not isinstance(reply.body, dict):
                return KeyOutcome(ref_label(ref), Outcome.FAILED, self._refused(reply))
            layout = reply.body.get("layout_info") or {}
            hits = {inst: v for inst, v in layout.items() if isinstance(v, list) and len(v) == 2 and v[1]}
            if not hits:
                return KeyOutcome(ref_label(ref), Outcome.SKIPPED, "not cached")
            return KeyOutcome(
                ref_label(ref),
                Outcome.APPLIED,
                ";".join(f"{i}:{loc}:{n}" for i, (loc, n) in sorted(hits.items())),
            )

        return self._each("lookup", blocks, one)

    def clear(self, where: Location) -> ActuationResult:
        t0 = self._clock()
        res = ActuationResult(self.name, "clear")
        inst = where.where or self.instance_id
        loc = LOCATIONS[where.tier]
        label = f"{inst}/{loc}"
        try:
            reply = self._post(res, "/clear", {"instance_id": inst, "location": loc})
            if reply.status == 200 and isinstance(reply.body, dict):
                res.outcomes.append(
                    KeyOutcome(label, Outcome.APPLIED, f"cleared {reply.body.get('num_tokens', 0)} tokens")
                )
            else:
                res.outcomes.append(KeyOutcome(label, Outcome.FAILED, self._refused(reply)))
        except (CircuitOpen, TransientError) as e:
            res.outcomes.append(KeyOutcome(label, Outcome.FAILED, f"unreachable: {e}"))
        res.elapsed_s = self._clock() - t0
        return res

    def _move(
        self, action: str, blocks: Sequence[BlockRef], src: Location, dst: Location, copy: bool
    ) -> ActuationResult:
        def one(res: ActuationResult, ref: BlockRef) -> KeyOutcome:
            body = {
                "old_position": [src.where or self.instance_id, LOCATIONS[src.tier]],
                "new_position": [dst.where or self.instance_id, LOCATIONS[dst.tier]],
                "tokens": list(ref.token_ids or ()),
                "should_copy": copy,
            }
            reply = self._post(res, "/move", body)
            if reply.status != 200 or not isinstance(reply.body, dict):
                return KeyOutcome(ref_label(ref), Outcome.FAILED, self._refused(reply))
            n = int(reply.body.get("num_tokens", 0))
            return KeyOutcome(
                ref_label(ref), Outcome.APPLIED if n > 0 else Outcome.SKIPPED, f"{action} {n} tokens"
            )

        return self._each(action, blocks, one)

    def move(self, blocks: Sequence[BlockRef], src: Location, dst: Location) -> ActuationResult:
        return self._move("move", blocks, src, dst, copy=False)

    def copy(self, blocks: Sequence[BlockRef], dst: Location) -> ActuationResult:
        return self._move("copy", blocks, Location(Tier.CPU, self.instance_id), dst, copy=True)

    def close(self) -> None:
        self.caller.close()


def build(
    base_url: str, instance_id: str, *, timeout_s: float = 10.0, resilient: Resilient | None = None
) -> LMCacheControllerActuator:
    """Default wiring: the controller's 500s are refusals (not retried); 502/504 and transport errors are."""
    caller = HttpCaller(
        base_url, timeout_s=timeout_s, resilient=resilient, retry_status=frozenset({502, 504})
    )
    return LMCacheControllerActuator(caller, instance_id=instance_id)
