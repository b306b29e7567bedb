"""Seeded fuzz of the KV-event subscriber over a REAL ZMQ socket pair on 127.0.0.1 (no vLLM needed).

A publisher sends a few thousand bad frames -- random bytes, truncated and byte-mutated msgpack of real event
batches, wrong top-level types, wrong frame counts, bad seq lengths, the replay end marker, spoofed sequence
numbers, events with wrong field types or unknown media -- interleaved with good batches in vLLM 0.33's wire
format, to the real :class:`KvEventSubscriber` receive loop. Every bad input must be counted in the
collector's errors under the expected kind, nothing may crash, and the good batches must end up in the index
exactly (an independent reference model of one source's residency per tier). Bad frames carry the last good
seq, so one that still decodes is refuted by the sequence check (kind ``sequence`` rather than ``frame``).

The publisher is an XPUB (a PUB that also reports subscriptions), so the test can wait for the subscription
to arrive instead of sleeping or losing the first frames to ZMQ's slow-joiner window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_kv_subscriber import KvEventSubscriber, KvSource
from kvtier.policies.tiers import Tier
from tests.collectors.test_kv_flood import close_subscriber

SEED = 20250611
N_BAD = 3000  # bad frames (plus bad events inside good batches)
TOPIC = b"kv"
POISON = 1 << 63  # hashes from here up appear only in inputs that must be rejected

enc = msgspec.msgpack.Encoder()

# (medium on the wire, tier) -- every known spelling class: vLLM, absent, any case, SGLang, LMCache, device
GOOD_MEDIA: list[tuple[Any, Tier]] = [
    ("GPU", Tier.GPU),
    ("GPU", Tier.GPU),
    (None, Tier.GPU),
    ("Gpu", Tier.GPU),
    ("cuda:0", Tier.GPU),
    ("CPU", Tier.CPU),
    ("cpu", Tier.CPU),
    ("CPU_PINNED", Tier.CPU),
    ("STORAGE", Tier.DISK),
    ("LocalDiskBackend", Tier.DISK),
    ("EXTERNAL", Tier.REMOTE),
]
# field -> wrong-typed values that make the event malformed (counted as kind "event", event skipped)
BAD_FIELDS: dict[str, list[Any]] = {
    "block_hashes": ["nope", None, [1.5], [True], [[1]], {"a": 1}, [None], [b""]],
    "parent_block_hash": ["x", 1.5, [1], True, {"k": 1}],
    "medium": [5, [b"x"], 1.5, True, {"m": "GPU"}],
    "type": ["Martian", 7, None, "blockstored"],
}
UNKNOWN_MEDIA = ["tape", "", "GPU0", "cuda:x", "l1:0", "hbm2", "\u00e9"]  # kind "unknown_medium"
# wrong-typed values of fields kvtier does not rely on: tolerated, the event is applied
TOLERATED: dict[str, list[Any]] = {
    "block_size": ["x", None, -1, 2**40, 1.5],
    "token_ids": ["x", 5, None, {"a": 1}, [1.5, "y"]],
    "group_idx": ["x", 1.5, [1]],
    "lora_name": [5, [1]],
    "lora_id": ["x", [1]],
    "zzz_unknown_field": [[1, 2], {"n": None}],
}


def batch_like(payload: bytes) -> bool:
    """Independent oracle: does this payload decode as ``[ts seconds, [events...], ...]`` at all?"""
    try:
        v = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return False
    return (
        isinstance(v, list)
        and len(v) >= 2
        and isinstance(v[1], list)
        and isinstance(v[0], int | float)
        and not isinstance(v[0], bool)
        and abs(v[0]) <= 1e12
    )


class Scenario:
    """Builds the frame stream and the expected outcome (errors by kind, residency per tier, event counts)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.frames: list[list[bytes]] = []
        self.errors: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.held: dict[Tier, set[int]] = {t: set() for t in Tier}
        self.seq = 0  # next good seq
        self.good = 0
        self.spoofs = 0
        self.next_hash = 1
        self.next_poison = POISON
        self.payloads: list[bytes] = []  # good payloads, material for truncation / mutation

    # ---- good batches ---------------------------------------------------------------------------------
    def _stored(self, medium: Any, tier: Tier) -> dict[str, Any]:
        n = self.rng.randint(1, 4)
        hs = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        mine = self.held[tier]
        parent = self.rng.choice(sorted(mine)) if mine and self.rng.random() < 0.5 else None
        self.held[tier].update(hs)
        e: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hs,
            "parent_block_hash": parent,
            "token_ids": [self.rng.randrange(32000) for _ in range(4 * n)],
            "block_size": 4,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "group_idx": 0,
        }
        if medium is None and self.rng.random() < 0.5:
            del e["medium"]  # absent = None = GPU
        return e

    def _good_event(self) -> Any:
        medium, tier = self.rng.choice(GOOD_MEDIA)
        r = self.rng.random()
        mine = self.held[tier]
        if r < 0.3 and mine:
            gone = self.rng.sample(sorted(mine), min(len(mine), self.rng.randint(1, 3)))
            mine.difference_update(gone)
            self.events["BlockRemoved"] += 1
            if self.rng.random() < 0.2:
                return ["BlockRemoved", gone, medium]  # older positional-array shape
            return {"type": "BlockRemoved", "block_hashes": gone, "medium": medium, "group_idx": 0}
        if r < 0.32:
            self.events["AllBlocksCleared"] += 1
            self.held[Tier.GPU].clear()
            return {"type": "AllBlocksCleared"}
        self.events["BlockStored"] += 1
        e = self._stored(medium, tier)
        if self.rng.random() < 0.15:  # a field kvtier does not need, wrongly typed: tolerated
            f = self.rng.choice(sorted(TOLERATED))
            e[f] = self.rng.choice(TOLERATED[f])
        if self.rng.random() < 0.15:
            return ["BlockStored", e["block_hashes"], e["parent_block_hash"], e["token_ids"], 4, None, medium]
        return e

    def _poison_stored(self) -> dict[str, Any]:
        self.next_poison += 1
        return {
            "type": "BlockStored",
            "block_hashes": [self.next_poison],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 4,
            "medium": "GPU",
        }

    def _bad_event(self) -> Any:
        """An event that must be skipped, and the error kind it is counted under."""
        r = self.rng.random()
        if r < 0.2:
            e: Any = self._poison_stored()
            e["medium"] = self.rng.choice(UNKNOWN_MEDIA)
            if self.rng.random() < 0.3:
                e = {"type": "AllBlocksCleared", "medium": e["medium"]}  # must not clear any tier
            self.errors["unknown_medium"] += 1
            return e
        self.errors["event"] += 1
        if r < 0.3:
            return self.rng.choice(
                [
                    5,
                    "str",
                    None,
                    1.5,
                    [],
                    ["BlockStored"],
                    ["BlockRemoved"],
                    [5, [1]],
                    ["BlockStored", "x", None, [], 4],
                    ["Martian", [1]],
                ]
            )
        e = self._poison_stored()
        f = self.rng.choice(sorted(BAD_FIELDS))
        v = self.rng.choice(BAD_FIELDS[f])
        if v is None and f == "block_hashes" and self.rng.random() < 0.5:
            del e[f]
        else:
            e[f] = v
        return e

    def good_batch(self) -> None:
        evs = [self._good_event() for _ in range(self.rng.randint(1, 6))]
        if self.rng.random() < 0.2:
            evs.insert(self.rng.randrange(len(evs) + 1), self._bad_event())
        dp: Any = 0 if self.rng.random() < 0.9 else self.rng.choice([None, "x"])  # dp_rank: tolerated
        payload = enc.encode([1.7e9 + self.seq, evs, dp])
        self.payloads.append(payload)
        self.frames.append([TOPIC, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        self.good += 1

    # ---- bad frames -----------------------------------------------------------------------------------
    def _stale(self) -> bytes:
        """The last good seq again: should a bad payload still decode, the frame is held and then refuted
        by the next frame (counted as ``sequence`` instead of ``frame``), never applied."""
        return (self.seq - 1).to_bytes(8, "big")

    def _not_a_batch(self, make: Any) -> bytes:
        while True:
            p: bytes = make()
            if not batch_like(p):
                return p

    def bad_frame(self) -> None:
        rng = self.rng
        kind = rng.choice(["count", "seqlen", "marker", "random", "truncated", "mutated", "types", "spoof"])
        real = rng.choice(self.payloads) if self.payloads else enc.encode([1.0, [self._poison_stored()], 0])
        if kind == "spoof":  # a well-formed batch with a wrong seq: held, then refuted by the next good one
            choices = [rng.randrange(self.seq + 1, 2**64 - 1), self.seq + rng.randint(1, 100)]
            if self.seq:
                choices += [rng.randrange(self.seq), self.seq - 1, 0]
            s = rng.choice(choices)
            self.frames.append(
                [
                    TOPIC,
                    s.to_bytes(8, "big"),
                    enc.encode([1.0, [self._poison_stored(), {"type": "AllBlocksCleared"}], 0]),
                ]
            )
            self.errors["sequence"] += 1
            self.spoofs += 1
            self.good_batch()
            return
        self.errors["frame"] += 1
        if kind == "count":
            n = rng.choice([1, 2, 4, 5])
            f = [
                TOPIC + bytes(rng.randrange(256) for _ in range(rng.randrange(3))),
                self._stale(),
                real,
                b"x",
                b"",
            ]
            self.frames.append(f[:n])
        elif kind == "seqlen":
            n = rng.choice([k for k in range(17) if k != 8])
            self.frames.append([TOPIC, bytes(rng.randrange(256) for _ in range(n)), real])
        elif kind == "marker":  # the replay end marker has no business on the event stream
            self.frames.append([TOPIC, b"\xff" * 8, real])
        elif kind == "random":
            p = self._not_a_batch(lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
            self.frames.append([TOPIC, self._stale(), p])
        elif kind == "truncated":  # msgpack is prefix-free: a strict prefix of a value never decodes
            self.frames.append([TOPIC, self._stale(), real[: rng.randrange(len(real))]])
        elif kind == "mutated":

            def mutate() -> bytes:
                b = bytearray(real)
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                return bytes(b)

            self.frames.append([TOPIC, self._stale(), self._not_a_batch(mutate)])
        else:
            ev = self._poison_stored()
            junk: object = rng.choice(
                [
                    {"a": 1},
                    [1.0],
                    [1.0, "x"],
                    ["ts", [ev]],
                    [True, [ev]],
                    [math.nan, [ev]],
                    [math.inf, [ev]],
                    [1e308, [ev]],
                    [-(2**63), [ev]],
                    "str",
                    5,
                    None,
                    [None, [ev]],
                    [[], [ev]],
                    [1.0, {"0": ev}],
                    b"\x00" * 8,
                    [1.0, None, 0],
                ]
            )
            self.frames.append([TOPIC, self._stale(), enc.encode(junk)])


def build(seed: int) -> Scenario:
    sc = Scenario(seed)
    for _ in range(5):
        sc.good_batch()
    bad = 0
    while bad < N_BAD:
        if sc.rng.random() < 0.12:
            sc.good_batch()
        else:
            sc.bad_frame()
            bad += 1
    for _ in range(20):  # the later good events
        sc.good_batch()
    return sc


def test_scenario_bad_frames_are_bad_by_construction() -> None:
    """The generator's own claims, checked with the independent oracle (no kvtier code): the only frames
    shaped like a batch message are the good batches and the spoofed-seq ones."""
    sc = build(SEED)
    assert sum(sc.errors.values()) >= N_BAD and sc.spoofs > 100 and sc.errors["unknown_medium"] > 20
    marker = b"\xff" * 8
    shaped = [f for f in sc.frames if len(f) == 3 and len(f[1]) == 8 and f[1] != marker and batch_like(f[2])]
    assert len(shaped) == sc.good + sc.spoofs
    assert sc.errors["frame"] == len(sc.frames) - len(shaped)


async def _run(sc: Scenario) -> tuple[KvEventSubscriber, float, dict[str, Any]]:
    """Publish the scenario to a real subscriber; (subscriber, errors metric, its source status) once done."""
    ctx = zmq.asyncio.Context()
    client = httpx.AsyncClient()
    reg = CollectorRegistry()
    sub = KvEventSubscriber(
        "vllm_kv_events:fuzz",
        "http://127.0.0.1:1",
        ingestor=KvIngestor(),
        client=client,
        registry=reg,
        context=ctx,
        replay_timeout_s=1.0,
    )
    sub.configure((KvSource(0, "tcp://127.0.0.1:0", None, TOPIC.decode()),))  # SUB binds a free port
    addr = sub.socket_endpoint(0)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    task = asyncio.create_task(sub.run())
    try:
        pub.connect(addr)
        assert await pub.poll(10_000), "no subscription arrived"
        assert await pub.recv() == b"\x01" + TOPIC
        for f in sc.frames:
            await pub.send_multipart(f)
        want = sum(sc.errors.values())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0
        while sub.batches < sc.good or sum(sub.health.errors_by_kind.values()) < want:
            assert not task.done(), task.exception()
            assert loop.time() < deadline, (
                sub.batches,
                sc.good,
                dict(sub.health.errors_by_kind),
                dict(sc.errors),
            )
            await asyncio.sleep(0.02)  # polling interval of a condition with a deadline
        assert not task.done(), task.exception()
        total = reg.get_sample_value("kvtier_collector_errors_total", {"collector": sub.name})
        return sub, float(total or 0), sub.status()["sources"][0]
    finally:
        await close_subscriber(task, pub, sub, client, ctx)


def test_fuzzed_frames_counted_nothing_crashes_good_events_exact(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="kvtier.collectors")  # thousands of expected warnings
    sc = build(SEED)
    sub, metric, src = asyncio.run(_run(sc))
    got = Counter(sub.health.errors_by_kind)
    assert metric == sum(got.values()) == sum(sc.errors.values())
    assert (got["event"], got["unknown_medium"]) == (sc.errors["event"], sc.errors["unknown_medium"])
    # a bad payload msgspec's typed decoder still accepts (e.g. invalid UTF-8 in a key it ignores) is held
    # for its stale seq and refuted: "sequence" instead of "frame", counted once either way, never applied
    assert got["frame"] + got["sequence"] == sc.errors["frame"] + sc.errors["sequence"]
    assert got["sequence"] >= sc.spoofs and set(got) <= set(sc.errors)
    assert (src["batches"], sub.lost, src["restarts"], src["held_seq"]) == (sc.good, 0, 0, None)
    assert src["rejected"] == got["sequence"]
    ing = sub.ingestor
    assert dict(ing.counts[sub.engine].events) == {
        k: sc.events[k] for k in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    }
    assert ing.blocks_tracked() == {t.value: len(sc.held[t]) for t in Tier}
    idx = ing.flushed_index()  # keeps evicted blocks (with no tier) for their statistics
    assert len(idx) == sc.next_hash - 1 and not any(h in idx for h in range(POISON, sc.next_poison + 1))
    for h in range(1, sc.next_hash):
        st = idx.get(h)
        assert st is not None and set(st.tiers) == {t for t in Tier if h in sc.held[t]}, h
