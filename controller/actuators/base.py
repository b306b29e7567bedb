"""The one actuator interface: every cache-layer adapter (lmcache-mp, mooncake, lmcache-controller,
vllm-warmup, shadow) implements :class:`Actuator`.

Conventions (all adapters):

- **Synchronous.** Every method blocks until the layer has answered (asynchronous layer operations --
  LMCache prefetches, Mooncake tasks -- are polled to completion or a deadline inside the call). The
  reconcile loop runs actuations in a worker thread (``asyncio.to_thread``) so a tick is never blocked
  by I/O; adapters use ``httpx.Client`` with explicit timeouts.
- **Batched, per-key outcomes.** Methods take a sequence of :class:`BlockRef` and return one
  :class:`ActuationResult` with a :class:`KeyOutcome` per addressed layer key (an LMCache prefix ref
  expands to one outcome per chunk).
- **Capabilities.** :meth:`Actuator.capabilities` lists the actions (``Capability`` values) the
  adapter can perform; any other method raises :class:`NotSupported`. The planner only plans
  advertised actions and records the rest as shadow decisions.
- **Safety.** No method ever deletes the last copy of a block, except :meth:`Actuator.evict`, whose
  purpose is to drop it. ``demote`` = copy, verify, then free; when the copy cannot be verified the
  key's outcome is ``skipped``.
- **Declared traits.** What the reconcile loop needs to know about a layer beyond its capabilities is a
  class attribute of :class:`Actuator` (``tiers``, ``token_addressed``, ``recreates``, ``records_only``,
  ``refreshes_pins``); the loop reads nothing else and never keys behaviour on an adapter's name.
- **Resilience.** Timeouts, retries with exponential backoff + jitter, and a circuit breaker
  (:mod:`kvtier.controller.actuators.resilience`); when the breaker is open calls fail fast with
  outcome ``failed`` and ``detail`` ``"circuit open"``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvtier.policies.tiers import Tier


class Capability(StrEnum):
    """Actions an adapter may advertise."""

    PROMOTE = "promote"  # move to a faster tier
    DEMOTE = "demote"  # move to a slower tier (copy, verify, free)
    PREFETCH = "prefetch"  # load ahead of use into a faster tier
    PIN = "pin"
    UNPIN = "unpin"
    EVICT = "evict"  # drop the block (all tiers, or one tier)
    CLEAR = "clear"  # drop a whole tier (not per key)
    QUOTA = "quota"  # per-tenant (cache_salt) capacity
    COPY = "copy"  # add a replica at a location
    MOVE = "move"  # move the replica between locations
    LOOKUP = "lookup"  # where is a block / how much of a prefix is cached
    HARD_PIN = "hard_pin"  # pin that the layer never evicts (may need a rewrite)


class Outcome(StrEnum):
    """The one outcome vocabulary: of an adapter's per-key actuation (``applied``, ``skipped``, ``failed``)
    and of a decision in the audit trail, which also has ``planned`` (not acted on yet) and ``shadow``
    (recorded only: shadow mode, no actuator can do it, or a records-only adapter)."""

    PLANNED = "planned"  # decided, not acted on yet (decisions only)
    SHADOW = "shadow"  # recorded, not acted on (decisions only)
    APPLIED = "applied"  # the layer confirmed the change
    FAILED = "failed"  # the layer refused or could not be reached
    SKIPPED = "skipped"  # nothing to do (already there) or refused for safety; see detail


#: the outcomes an adapter reports per key
ACTUATION_OUTCOMES = frozenset({Outcome.APPLIED, Outcome.FAILED, Outcome.SKIPPED})


class NotSupported(Exception):
    """The adapter does not advertise this action."""


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One addressable unit in a cache layer.

    ``layer_key``: the layer's own key (LMCache ``chunk_hash_hex``; Mooncake object key; vLLM block hash
    hex); may be empty when the ref is token-addressed. ``token_ids``: the full prefix (root first) up to
    and including this unit, for token-addressed layers (an LMCache ref with tokens stands for every full
    chunk of that prefix). ``cache_salt``: tenant / isolation salt. ``rank``: TP rank / kv_rank shard, or
    None for "all ranks".
    """

    layer_key: str = ""
    model: str = ""
    token_ids: tuple[int, ...] | None = None
    cache_salt: str = ""
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class Location:
    """Where a replica lives: a kvtier tier plus the layer's own place name (Mooncake segment,
    LMCache controller ``instance_id``); ``where`` may be empty when the tier alone is enough."""

    tier: Tier
    where: str = ""


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    key: str
    outcome: Outcome
    detail: str = ""


@dataclass(slots=True)
class ActuationResult:
    """Outcome of one adapter call. ``elapsed_s`` wall seconds; ``attempts`` requests sent incl. retries."""

    layer: str
    action: str
    outcomes: list[KeyOutcome] = field(default_factory=list)
    attempts: int = 0
    elapsed_s: float = 0.0
    handle: str | None = None  # layer request / task id, when there is one

    @property
    def ok(self) -> bool:
        """True when no key failed."""
        return all(o.outcome is not Outcome.FAILED for o in self.outcomes)

    def count(self, outcome: Outcome) -> int:
        return sum(1 for o in self.outcomes if o.outcome is outcome)

    def by_key(self) -> dict[str, KeyOutcome]:
        return {o.key: o for o in self.outcomes}


def all_keys(keys: Iterable[str], outcome: Outcome, detail: str) -> list[KeyOutcome]:
    return [KeyOutcome(k, outcome, detail) for k in keys]


@dataclass(frozen=True, slots=True)
class AdapterHealth:
    """Adapter reachability as seen by its circuit breaker."""

    layer: str
    breaker: str  # "closed" | "open" | "half_open"
    consecutive_failures: int
    last_error: str = ""


class Actuator(ABC):
    """Base class for cache-layer adapters. Subclasses override the methods they advertise and declare
    their traits (class attributes below; the defaults describe a plain key-addressed layer)."""

    name: str = "abstract"
    #: the kvtier tiers this layer holds copies in; a move is routed here only when both its ends are among
    #: them (a gpu -> cpu demote is not LMCache's to make). None: any tier (shadow).
    tiers: frozenset[Tier] | None = None
    #: one ref stands for every chunk of its token prefix; the layer answers per chunk, so the loop calls it
    #: ref by ref to attribute an outcome to each decision
    token_addressed: bool = False
    #: can bring back a block resident nowhere (recompute through the engine): ``admit`` moves route here
    recreates: bool = False
    #: records decisions without touching any layer (shadow): its outcomes count as ``shadow``, and it takes
    #: every action, admissions included
    records_only: bool = False
    #: pins are emulated: :meth:`refresh_pins` must run once per active tick (maintenance hook)
    refreshes_pins: bool = False

    @abstractmethod
    def capabilities(self) -> frozenset[Capability]:
        """The actions this adapter performs; every other action method raises NotSupported."""

    def supports(self, cap: Capability | str) -> bool:
        return Capability(cap) in self.capabilities()

    def _unsupported(self, cap: Capability) -> NotSupported:
        return NotSupported(f"actuator {self.name!r} does not support {cap.value!r}")

    def promote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        raise self._unsupported(Capability.PROMOTE)

    def demote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        raise self._unsupported(Capability.DEMOTE)

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        raise self._unsupported(Capability.PREFETCH)

    def pin(self, blocks: Sequence[BlockRef], tier: Tier, ttl_s: float | None = None) -> ActuationResult:
        raise self._unsupported(Capability.PIN)

    def unpin(self, blocks: Sequence[BlockRef], tier: Tier) -> ActuationResult:
        raise self._unsupported(Capability.UNPIN)

    def evict(self, blocks: Sequence[BlockRef], tier: Tier | None = None) -> ActuationResult:
        """Drop blocks from ``tier`` (None = every tier of this layer)."""
        raise self._unsupported(Capability.EVICT)

    def clear(self, where: Location) -> ActuationResult:
        raise self._unsupported(Capability.CLEAR)

    def copy(self, blocks: Sequence[BlockRef], dst: Location) -> ActuationResult:
        raise self._unsupported(Capability.COPY)

    def move(self, blocks: Sequence[BlockRef], src: Location, dst: Location) -> ActuationResult:
        raise self._unsupported(Capability.MOVE)

    def lookup(self, blocks: Sequence[BlockRef]) -> ActuationResult:
        """Where each block is; outcome ``applied`` = found, detail = location(s)."""
        raise self._unsupported(Capability.LOOKUP)

    def set_quota(self, cache_salt: str, limit_bytes: int | None) -> ActuationResult:
        """Cap a tenant's usage (None removes the cap)."""
        raise self._unsupported(Capability.QUOTA)

    def refresh_pins(self) -> ActuationResult:
        """Maintenance hook of layers with ``refreshes_pins``: re-assert every pin (re-load what the layer
        evicted under pressure). Called once per active tick."""
        raise NotSupported(f"actuator {self.name!r} does not refresh pins")

    def health(self) -> AdapterHealth:
        return AdapterHealth(self.name, "closed", 0)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients."""
