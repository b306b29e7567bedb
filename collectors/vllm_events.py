"""Decode vLLM KV-cache event frames (pure, no I/O).

Wire format (``vllm/distributed/kv_events.py``): one ZMQ multipart message per batch with three frames
``(topic, seq as 8-byte big-endian unsigned, msgpack payload)``. The payload is ``[ts, events, dp_rank]``
(array-like ``EventBatch``). Events are msgpack maps tagged by ``"type"`` in vLLM >= PR #42892 (0.32/0.33) and
positional arrays ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]`` before.
Both shapes are accepted. Block hashes are ints (uint64) or raw digests (bytes; folded to the low 64 bits as
vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). ``medium`` is normalised to a kvtier
:class:`~kvtier.policies.tiers.Tier`: GPU/CPU/STORAGE in any case, SGLang and LMCache spellings, torch device
strings (``cuda:0``), and None/absent = ``gpu`` (``medium`` is ``str|None``; the GPU block pool's own events
and vLLM's ``AllBlocksCleared``, which has no fields). An unrecognised medium is never guessed: the event is
skipped and listed in :attr:`DecodedBatch.unknown_media` (the subscriber counts it as an ``unknown_medium``
collector error). A batch ``ts`` that is not a number of seconds within ``±MAX_TS_S`` makes the frame
malformed (the index keeps times as float ms; an overflowing one would poison its statistics).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from kvtier.policies.tiers import Tier, normalize_tier

MAX_TS_S = 1e12  # |batch ts| above this (seconds; year ~33,700) is not a wall-clock time: malformed frame
_MASK64 = (1 << 64) - 1
_SEQ = struct.Struct(">Q")


class DecodeError(ValueError):
    """A frame or event that cannot be decoded (counted and skipped by the subscriber)."""


class UnknownMediumError(DecodeError):
    """An event ``medium`` that is not a known tier spelling (never mapped to a guessed tier)."""


# Media spellings the typed fast path accepts (msgspec checks them in C); any other string sends the batch
# down the slow path, which normalises case / aliases and skips unknown media. Each must be known to tier_of.
FAST_MEDIA: tuple[str, ...] = (
    "GPU", "CPU", "STORAGE", "gpu", "cpu", "storage",  # vLLM; LMCache legacy ("cpu")
    "CPU_PINNED", "DISK", "EXTERNAL", "cpu_pinned", "disk", "external",  # SGLang
    *(f"cuda:{i}" for i in range(16)),  # torch device strings (LMCache legacy's tokens.device)
)  # fmt: skip
if TYPE_CHECKING:
    _Medium = str
else:
    _Medium = Literal[FAST_MEDIA]


# ---- msgspec schema of the 0.33 map-tagged events (unknown fields are ignored) ----------------------------
class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]  # bytes digests are folded to ints (slow path) -> always ints here
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # msgpack bytes, decoded on demand by tokens()
    block_size: int = 0
    lora_id: int | None = None
    medium: _Medium | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def tokens(self) -> list[int]:
        """Token ids of the stored blocks (decoded on demand)."""
        v = _generic.decode(self.token_ids)
        return v if isinstance(v, list) else []


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    medium: _Medium | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    medium: _Medium | None = None  # not in vLLM; LMCache / connectors may scope a clear to a tier


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | list[Any]]
    data_parallel_rank: int | None = None


_typed = msgspec.msgpack.Decoder(_Batch)
_generic = msgspec.msgpack.Decoder()
_enc = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class DecodedBatch:
    """One decoded KV-event batch. ``ts`` in seconds (publisher's wall clock)."""

    topic: bytes
    seq: int
    ts: float
    events: list[Event]
    dp_rank: int | None
    skipped: int  # events in the payload that were malformed / of unknown type and were skipped
    unknown_media: tuple[str | None, ...] = ()  # media of the events skipped as unknown spellings (one each)


_tier_cache: dict[str | None, Tier] = {None: Tier.GPU}  # known spellings only (bounded)
_DEVICES = {"cuda": Tier.GPU, "cpu": Tier.CPU}  # torch device types with an index, e.g. "cuda:0"


def block_key(h: int | bytes) -> int:
    """A block hash as an unsigned 64-bit int (bytes digests: the low 64 bits, big-endian, as vLLM does)."""
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _MASK64
    if isinstance(h, bytes | bytearray):
        if not h:
            raise DecodeError("empty block hash")
        return int.from_bytes(h, "big") & _MASK64
    raise DecodeError(f"block hash of type {type(h).__name__}")


def tier_of(medium: str | None) -> Tier:
    """Normalise an event ``medium`` (any case; vLLM/SGLang/LMCache spellings, ``cuda:0``-style device
    strings); None -> GPU. Raises :class:`UnknownMediumError` for anything else."""
    t = _tier_cache.get(medium)
    if t is None:
        if not isinstance(medium, str):
            raise UnknownMediumError(f"medium of type {type(medium).__name__}")
        try:
            t = normalize_tier(medium)
        except ValueError:
            base, sep, idx = medium.strip().lower().partition(":")  # torch device (LMCache's tokens.device)
            if not (sep and idx.isdigit() and base in _DEVICES):
                raise UnknownMediumError(f"unknown medium {medium[:64]!r}") from None
            t = _DEVICES[base]
        if len(_tier_cache) < 1024:
            _tier_cache[medium] = t
    return t


def _drop_unknown_media(evs: list[Event]) -> tuple[list[Event], tuple[str | None, ...]]:
    """Events whose medium is a known spelling, and the media of those dropped (one per event)."""
    cache = _tier_cache
    bad: set[str | None] | None = None
    for e in evs:
        m = e.medium
        if m not in cache:
            try:
                tier_of(m)
            except UnknownMediumError:
                if bad is None:
                    bad = set()
                bad.add(m)
    if bad is None:
        return evs, ()
    return [e for e in evs if e.medium not in bad], tuple(e.medium for e in evs if e.medium in bad)


def parse_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame as an int (-1 = replay end marker)."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame has {len(frame)} bytes, expected 8")
    seq: int = _SEQ.unpack(frame)[0]
    return -1 if seq == _MASK64 else seq


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(h, int | bytes) and not isinstance(h, bool) for h in v):
        raise DecodeError(f"block_hashes must be a list of int/bytes, got {type(v).__name__}")
    return [block_key(h) for h in v]


def _parent(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, int | bytes) and not isinstance(v, bool):
        return block_key(v)
    raise DecodeError("bad parent_block_hash")


def _raw(tokens: Any) -> msgspec.Raw:
    return msgspec.Raw(_enc.encode(tokens if isinstance(tokens, list) else []))


def _opt_str(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise DecodeError(f"expected str or nil, got {type(v).__name__}")


def _from_array(e: list[Any]) -> Event:
    """Older positional-array event -> struct."""
    if not e or not isinstance(e[0], str):
        raise DecodeError("array event without a type tag")
    kind = e[0]
    if kind == "BlockStored":
        if len(e) < 5:
            raise DecodeError(f"BlockStored array has {len(e)} fields")
        parent = _parent(e[2])
        tokens = e[3] if isinstance(e[3], list) else []
        return BlockStored(
            block_hashes=_hashes(e[1]),
            parent_block_hash=parent,
            token_ids=_raw(tokens),
            block_size=e[4] if isinstance(e[4], int) else 0,
            lora_id=e[5] if len(e) > 5 and isinstance(e[5], int) else None,
            medium=_opt_str(e[6]) if len(e) > 6 else None,
        )
    if kind == "BlockRemoved":
        if len(e) < 2:
            raise DecodeError("BlockRemoved array without hashes")
        return BlockRemoved(block_hashes=_hashes(e[1]), medium=_opt_str(e[2]) if len(e) > 2 else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError(f"unknown event type {kind!r}")


def _from_map(e: dict[Any, Any]) -> Event:
    kind = e.get("type")
    if kind == "BlockStored":
        parent = _parent(e.get("parent_block_hash"))
        bs = e.get("block_size", 0)
        return BlockStored(
            block_hashes=_hashes(e.get("block_hashes")),
            parent_block_hash=parent,
            token_ids=_raw(e.get("token_ids")),
            block_size=bs if isinstance(bs, int) else 0,
            medium=_opt_str(e.get("medium")),
            group_idx=e.get("group_idx") if isinstance(e.get("group_idx"), int) else None,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(e.get("block_hashes")), medium=_opt_str(e.get("medium")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(medium=_opt_str(e.get("medium")))
    raise DecodeError(f"unknown event type {kind!r}")


def _ts(ts: Any) -> float:
    if isinstance(ts, int | float) and not isinstance(ts, bool) and -MAX_TS_S <= ts <= MAX_TS_S:
        return float(ts)
    raise DecodeError(f"batch ts is not a time in seconds: {ts!r:.40}")


def _slow(payload: bytes) -> tuple[float, list[Event], int | None, int]:
    """Generic decode; convert event by event so one bad event does not lose the batch."""
    try:
        raw = _generic.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise DecodeError(f"payload is not an event batch [ts, events, dp_rank]: {type(raw).__name__}")
    ts = _ts(raw[0])
    dp = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    out: list[Event] = []
    skipped = 0
    for e in raw[1]:
        try:
            if isinstance(e, dict):
                out.append(_from_map(e))
            elif isinstance(e, list):
                out.append(_from_array(e))
            else:
                raise DecodeError(f"event of type {type(e).__name__}")
        except DecodeError:
            skipped += 1
    return ts, out, dp, skipped


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int, tuple[str | None, ...]]:
    """msgpack payload -> (ts seconds, events, dp_rank, number of malformed events skipped, media of the
    events skipped for an unknown medium). Raises :class:`DecodeError` if it is no event batch."""
    try:
        b = _typed.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        ts, slow_evs, dp, skipped = _slow(payload)
        slow_kept, slow_unknown = _drop_unknown_media(slow_evs)
        return ts, slow_kept, dp, skipped, slow_unknown
    if not -MAX_TS_S <= b.ts <= MAX_TS_S:  # also NaN
        raise DecodeError(f"batch ts is not a time in seconds: {b.ts}")
    evs: list[Any] = b.events  # map events' media are FAST_MEDIA (checked by msgspec)
    if list not in map(type, evs):  # older positional-array events? (C-level scan; rare with vLLM >= 0.32)
        return b.ts, evs, b.data_parallel_rank, 0, ()
    n_bad = 0
    for i, e in enumerate(evs):
        if isinstance(e, list):
            try:
                evs[i] = _from_array(e)
            except DecodeError:
                evs[i] = None
                n_bad += 1
    kept, unknown = _drop_unknown_media([e for e in evs if e is not None])
    return b.ts, kept, b.data_parallel_rank, n_bad, unknown


def decode_frames(frames: list[bytes]) -> DecodedBatch:
    """A 3-frame ZMQ message -> :class:`DecodedBatch`. Raises :class:`DecodeError` for a malformed message."""
    if len(frames) != 3:
        raise DecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_b, payload = frames
    seq = parse_seq(seq_b)
    ts, events, dp, skipped, unknown = decode_payload(payload)
    topic_b = topic if type(topic) is bytes else bytes(topic)
    return DecodedBatch(topic_b, seq, ts, events, dp, skipped, unknown)
