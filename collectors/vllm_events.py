"""Decode vLLM KV-cache event frames (pure, no I/O).

Wire format (``vllm/distributed/kv_events.py``): one ZMQ multipart message per batch with three frames
``(topic, seq as 8-byte big-endian unsigned, msgpack payload)``. The payload is ``[ts, events, dp_rank]``
(array-like ``EventBatch``). Events are msgpack maps tagged by ``"type"`` in vLLM >= PR #42892 (0.32/0.33) and
positional arrays ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]`` before.
Both shapes are accepted. Block hashes are ints (uint64) or raw digests (bytes; folded to the low 64 bits as
vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). ``medium`` is normalised to a kvtier
:class:`~kvtier.policies.tiers.Tier` (None/unknown -> ``gpu``, the GPU block pool's own events).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.policies.tiers import Tier, normalize_tier

_MASK64 = (1 << 64) - 1
_SEQ = struct.Struct(">Q")


class DecodeError(ValueError):
    """A frame or event that cannot be decoded (counted and skipped by the subscriber)."""


# ---- msgspec schema of the 0.33 map-tagged events (unknown fields are ignored) ----------------------------
class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]  # bytes digests are folded to ints (slow path) -> always ints here
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # msgpack bytes, decoded on demand by tokens()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
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
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    medium: str | None = None  # not in vLLM; LMCache / connectors may scope a clear to a tier


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


_tier_cache: dict[str | None, Tier] = {}


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
    """Normalise an event ``medium`` (any case; vLLM/SGLang/LMCache spellings). None/unknown -> GPU."""
    t = _tier_cache.get(medium)
    if t is None:
        t = normalize_tier(medium, default=Tier.GPU)
        if len(_tier_cache) < 1024:
            _tier_cache[medium] = t
    return t


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


def _slow(payload: bytes) -> tuple[float, list[Event], int | None, int]:
    """Generic decode; convert event by event so one bad event does not lose the batch."""
    try:
        raw = _generic.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise DecodeError(f"payload is not an event batch [ts, events, dp_rank]: {type(raw).__name__}")
    ts = raw[0] if isinstance(raw[0], int | float) and not isinstance(raw[0], bool) else 0.0
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
    return float(ts), out, dp, skipped


def decode_payload(payload: bytes) -> tuple[float, list[Event], int | None, int]:
    """msgpack payload -> (ts seconds, events, dp_rank, skipped events). Raises :class:`DecodeError`."""
    try:
        b = _typed.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _slow(payload)
    evs = b.events
    skipped = 0
    if list in map(type, evs):  # older positional-array events (C-level scan; rare with vLLM >= 0.32)
        for i, e in enumerate(evs):
            if isinstance(e, list):
                try:
                    evs[i] = _from_array(e)
                except DecodeError:
                    evs[i] = None  # type: ignore[call-overload]
                    skipped += 1
        if skipped:
            evs = [e for e in evs if e is not None]
    return b.ts, evs, b.data_parallel_rank, skipped  # type: ignore[return-value]


def decode_frames(frames: list[bytes]) -> DecodedBatch:
    """A 3-frame ZMQ message -> :class:`DecodedBatch`. Raises :class:`DecodeError` for a malformed message."""
    if len(frames) != 3:
        raise DecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_b, payload = frames
    seq = parse_seq(seq_b)
    ts, events, dp, skipped = decode_payload(payload)
    return DecodedBatch(topic if type(topic) is bytes else bytes(topic), seq, ts, events, dp, skipped)
