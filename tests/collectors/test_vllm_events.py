"""KV-event decoding and the subscriber's sequence handling.

The gap/replay/restart tests drive the real subscriber over real ZMQ sockets (PUB + ROUTER in the test)
because a real vLLM cannot be made to drop a batch on demand; the real-vLLM scenarios are in
test_vllm_live.py.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import (
    FAST_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    UnknownMediumError,
    decode_frames,
    decode_payload,
    tier_of,
)
from kvtier.collectors.vllm_kv_subscriber import KvEventSubscriber, KvSource, parse_sources, subscriber_plan
from kvtier.policies.tiers import Tier

enc = msgspec.msgpack.Encoder()


def stored(hashes: list[int], parent: int | None = None, medium: str | None = "GPU") -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [1] * 32,
            "block_size": 32, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


def frames(seq: int, events: list[object]) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), enc.encode([1.5, events, 0])]


def test_map_and_array_events_bytes_hashes_and_medium() -> None:
    digest = bytes(range(32))
    f = frames(7, [stored([1, 2**64 - 1]), ["BlockStored", [digest], 2, [5, 6], 32, None, "cpu_pinned"],
                   ["BlockRemoved", [3], "STORAGE"], {"type": "AllBlocksCleared"}, {"type": "Martian"}])  # fmt: skip  # noqa: E501
    b = decode_frames(f)
    assert b.seq == 7 and b.dp_rank == 0 and b.skipped == 1
    s0, s1, r, _ = b.events
    assert isinstance(s0, BlockStored) and s0.block_hashes == [1, 2**64 - 1] and s0.tokens() == [1] * 32
    assert isinstance(s1, BlockStored) and s1.tokens() == [5, 6] and s1.medium == "cpu_pinned"
    assert isinstance(r, BlockRemoved)
    ing = KvIngestor()
    ing.apply("e", b)
    # AllBlocksCleared (no medium) is the GPU pool's clear: the host-tier block stays
    assert ing.blocks_tracked() == {"gpu": 0, "cpu": 1, "disk": 0, "remote": 0}
    ing.apply(
        "e",
        decode_frames(
            frames(8, [s for s in [stored([10, 11])]] + [["BlockStored", [digest], None, [], 0, None, "CPU"]])
        ),
    )
    assert ing.blocks_tracked()["gpu"] == 2 and ing.blocks_tracked()["cpu"] == 1
    assert int.from_bytes(digest, "big") & (2**64 - 1) in ing.flushed_index()


@pytest.mark.parametrize(
    "bad",
    [[b"kv", b"\x00" * 8], [b"kv", b"\x00", b"\x90"], [b"kv", b"\x00" * 8, b"\xdc\x00\x05\x01"],
     [b"kv", b"\x00" * 8, enc.encode({"a": 1})], [b"kv", b"\x00" * 8, enc.encode([1.0, "x"])]],
)  # fmt: skip
def test_malformed_frames_raise_decode_error(bad: list[bytes]) -> None:
    with pytest.raises(DecodeError):
        decode_frames(bad)


def test_wrong_types_inside_events_skip_only_that_event() -> None:
    ts, evs, dp, skipped, _ = decode_payload(enc.encode([1.0, [stored([1]), {"type": "BlockStored",
                                                     "block_hashes": "nope"}, ["BlockRemoved", [1], 5]], None]))  # fmt: skip  # noqa: E501
    assert len(evs) == 1 and skipped == 2 and dp is None


def test_refcount_across_engines_and_restart_clear() -> None:
    ing = KvIngestor()
    ing.apply_events("a", decode_payload(enc.encode([0, [stored([1, 2])]]))[1], 0.0)
    ing.apply_events("b", decode_payload(enc.encode([0, [stored([2, 3])]]))[1], 0.0)
    assert ing.blocks_tracked()["gpu"] == 3
    ing.apply_events("a", [BlockRemoved(block_hashes=[2], medium="GPU")], 1.0)
    # b still holds 2
    st = ing.flushed_index().get(2)
    assert ing.blocks_tracked()["gpu"] == 3 and st is not None and Tier.GPU in st.tiers
    assert ing.clear_source("b") == 2
    assert ing.blocks_tracked()["gpu"] == 1


def test_sources_and_bind_connect_rule() -> None:
    src = parse_sources(
        '{"0": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": null, "topic": "kv"},'
        ' "1": {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:6000", "topic": ""}}'
    )
    assert src[0] == KvSource(0, "tcp://127.0.0.1:5557", None, "kv")
    assert subscriber_plan(src[0].endpoint, "h") == ("bind", "tcp://127.0.0.1:5557")
    assert subscriber_plan(src[1].endpoint, "10.0.0.2") == ("connect", "tcp://10.0.0.2:5558")
    assert subscriber_plan("ipc:///tmp/x.ipc", "h") == ("connect", "ipc:///tmp/x.ipc")
    assert subscriber_plan("tcp://[::]:9", "h")[0] == "connect"
    with pytest.raises(ValueError):
        subscriber_plan("inproc://x", "h")


async def _gap_scenario(replay: bool) -> KvEventSubscriber:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    sub = KvEventSubscriber("kv:test", "http://127.0.0.1:1", ingestor=KvIngestor(), client=httpx.AsyncClient(),  # noqa: E501
                            registry=CollectorRegistry(), context=ctx, replay_timeout_s=5.0)  # fmt: skip
    src = KvSource(0, "tcp://127.0.0.1:0", f"tcp://127.0.0.1:{rport}" if replay else None, "kv")
    sub.configure((src,))
    buffered = {s: frames(s, [stored([100 + s])]) for s in range(5)}

    async def serve_replay() -> None:
        cid, _, start = await router.recv_multipart()
        for s in range(int.from_bytes(start, "big"), 5):
            await router.send_multipart([cid, b"", *buffered[s]])
        await router.send_multipart([cid, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    task = asyncio.create_task(serve_replay()) if replay else None
    await sub.handle(0, buffered[0])
    await sub.handle(0, buffered[4])  # 1..3 missing: held until the next frame confirms the jump
    assert sub.ingestor.counts[sub.engine].blocks_stored == 1 and sub.lost == 0
    await sub.handle(0, frames(5, [stored([105])]))  # confirms 4: replay 1..3 (or count them lost)
    if task is not None:
        await task
    await sub.handle(0, frames(0, [stored([999])]))  # sequence went back: held...
    assert sub.ingestor.blocks_tracked()["gpu"] == (6 if replay else 3)
    await sub.handle(0, frames(1, [stored([998])]))  # ...until the restarted publisher's next batch
    assert sub.status()["sources"][0]["restarts"] == 1
    await sub.aclose()
    router.close(linger=0)
    ctx.term()
    return sub


def test_gap_filled_from_replay() -> None:
    sub = asyncio.run(_gap_scenario(replay=True))
    assert sub.replayed == 3 and sub.lost == 0 and sub.ingestor.counts[sub.engine].blocks_stored == 8
    assert sub.ingestor.blocks_tracked()["gpu"] == 2  # the restart dropped the old process's blocks
    assert sub.health.errors_by_kind == {}


def test_gap_without_replay_counted_lost() -> None:
    sub = asyncio.run(_gap_scenario(replay=False))
    assert sub.lost == 3 and sub.replayed == 0
    assert sub.ingestor.blocks_tracked()["gpu"] == 2
    assert sub.health.errors_by_kind == {}


@pytest.mark.parametrize(
    ("medium", "tier"),
    [(None, Tier.GPU), ("GPU", Tier.GPU), ("gpu", Tier.GPU), ("CPU", Tier.CPU), ("Cpu", Tier.CPU),
     ("STORAGE", Tier.DISK), ("storage", Tier.DISK), ("CPU_PINNED", Tier.CPU), ("DISK", Tier.DISK),
     ("EXTERNAL", Tier.REMOTE), ("LocalCPUBackend", Tier.CPU), ("L2", Tier.DISK), ("cuda:0", Tier.GPU),
     ("cpu", Tier.CPU)],
)  # fmt: skip
def test_known_media(medium: str | None, tier: Tier) -> None:
    assert tier_of(medium) is tier
    assert decode_frames(frames(0, [stored([1], medium=medium)])).events[0].medium == medium


def test_fast_path_media_are_known_and_others_take_the_slow_path() -> None:
    assert all(tier_of(m) for m in FAST_MEDIA)
    b = decode_frames(frames(0, [stored([1], medium="Gpu"), stored([2], medium="LocalDiskBackend")]))
    assert [tier_of(e.medium) for e in b.events] == [Tier.GPU, Tier.DISK] and not b.unknown_media


def test_unknown_medium_is_a_counted_skip_never_gpu() -> None:
    """Unknown spellings are skipped and counted as ``unknown_medium`` errors; absent/None medium is GPU."""
    for bad in ("Martian", "", "gpu0", "cuda:x", "l1:0"):
        with pytest.raises(UnknownMediumError):
            tier_of(bad)
    no_medium = {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None, "token_ids": [],
                 "block_size": 32}  # fmt: skip
    evs = [stored([1]), stored([2], medium="Martian"), no_medium, ["BlockStored", [5], None, [], 32],
           ["BlockStored", [6], None, [], 32, None, "tape"], ["BlockRemoved", [1], "TAPE"],
           {"type": "AllBlocksCleared", "medium": "tape"}, stored([7], medium="cuda:0")]  # fmt: skip
    b = decode_frames(frames(0, evs))
    assert b.unknown_media == ("Martian", "tape", "TAPE", "tape") and b.skipped == 0
    assert [type(e) for e in b.events] == [BlockStored] * 4

    async def run() -> KvEventSubscriber:
        sub = _sub()
        await sub.handle(0, frames(0, evs))
        await sub.aclose()
        return sub

    sub = asyncio.run(run())
    assert sub.health.errors_by_kind == {"unknown_medium": 4}
    assert sub.registry.get_sample_value("kvtier_collector_errors_total", {"collector": sub.name}) == 4
    # nothing was guessed: block 2/6 nowhere, block 1 not removed, the GPU pool not cleared
    assert sub.ingestor.blocks_tracked() == {"gpu": 4, "cpu": 0, "disk": 0, "remote": 0}
    assert 2 not in sub.ingestor.flushed_index() and 6 not in sub.ingestor.flushed_index()
    # direct callers of the ingestor (no decoder in between) get the same skip, counted
    ing = KvIngestor()
    ing.apply_events("e", [BlockStored(block_hashes=[1], medium="Martian"), BlockRemoved(block_hashes=[1],
                     medium="tape"), AllBlocksCleared(medium="tape"), BlockStored(block_hashes=[3])], 0.0)  # fmt: skip  # noqa: E501
    c = ing.counts["e"]
    assert c.unknown_medium == 3 and c.events == {"BlockStored": 1, "BlockRemoved": 0, "AllBlocksCleared": 0}
    assert ing.blocks_tracked()["gpu"] == 1


def _sub(replay_endpoint: str | None = None) -> KvEventSubscriber:
    """A subscriber whose SUB socket is bound to a free port (tests call ``handle`` directly)."""
    sub = KvEventSubscriber("kv:test", "http://127.0.0.1:1", ingestor=KvIngestor(), client=httpx.AsyncClient(),  # noqa: E501
                            registry=CollectorRegistry(), context=zmq.asyncio.Context.instance())  # fmt: skip
    sub.configure((KvSource(0, "tcp://127.0.0.1:0", replay_endpoint, "kv"),))
    return sub


def test_one_spoofed_seq_never_counts_a_loss_or_clears_the_index() -> None:
    """A single frame with a wild seq (far ahead, a little ahead, behind, a duplicate, the replay end marker)
    is held, then dropped as a ``sequence`` error when the stream carries on; real gaps and restarts are
    still believed once the next frame confirms them."""

    async def run() -> None:
        sub = _sub()
        st = lambda: sub.status()["sources"][0]  # noqa: E731
        sub.note_engine_start(1000.0)  # the first process's start time, from /metrics
        for s in range(3):
            await sub.handle(0, frames(s, [stored([10 + s])]))
        # far ahead, max u64 - 1, ahead within max_seq_gap, behind (a restart's seq 0), repeats of the last
        spoofs = [2**62, 2**64 - 2, 3 + 50, 0, 3 + 4 - 1, 3 + 5 - 1]
        for i, spoof in enumerate(spoofs):
            await sub.handle(0, frames(spoof, [stored([666 + i]), {"type": "AllBlocksCleared"}]))
            assert st()["held_seq"] == spoof
            await sub.handle(0, frames(3 + i, [stored([13 + i])]))
        await sub.handle(0, [b"kv", b"\xff" * 8, enc.encode([1.5, [{"type": "AllBlocksCleared"}], 0])])
        assert sub.lost == 0 and st()["restarts"] == 0 and st()["held_seq"] is None
        assert sub.health.errors_by_kind == {"sequence": len(spoofs), "frame": 1} and st()["rejected"] == 6
        idx = sub.ingestor.flushed_index()
        assert sub.ingestor.blocks_tracked()["gpu"] == 9 and all(10 + k in idx for k in range(9))
        assert not any(666 + i in idx for i in range(len(spoofs)))
        # a real gap: believed when the next frame continues after it (no replay endpoint: counted lost)
        await sub.handle(0, frames(100, [stored([100])]))
        await sub.handle(0, frames(101, [stored([101])]))
        assert sub.lost == 100 - 9 and st()["next_seq"] == 102
        # a far jump is believed too, if two frames agree (a long disconnection)
        await sub.handle(0, frames(10**9, [stored([102])]))
        await sub.handle(0, frames(10**9 + 1, [stored([103])]))
        assert sub.lost == 10**9 - 9 - 2 and sub.ingestor.blocks_tracked()["gpu"] == 13
        # a real restart: seq 0 then 1 from the new process clears what the old one held
        await sub.handle(0, frames(0, [stored([200])]))
        assert sub.ingestor.blocks_tracked()["gpu"] == 13
        await sub.handle(0, frames(1, [stored([201])]))
        assert st()["restarts"] == 1 and sub.ingestor.blocks_tracked()["gpu"] == 2
        sub.note_engine_start(1500.0)  # the same restart seen in /metrics: not cleared twice
        assert st()["restarts"] == 1 and sub.ingestor.blocks_tracked()["gpu"] == 2
        # ... or seq 0 confirmed by a new process start time
        await sub.handle(0, frames(0, [stored([300])]))
        assert sub.ingestor.blocks_tracked()["gpu"] == 2
        sub.note_engine_start(2000.0)
        assert st()["restarts"] == 2 and st()["held_seq"] is None and st()["next_seq"] == 1
        assert sub.ingestor.blocks_tracked()["gpu"] == 1 and sub.health.errors_by_kind["sequence"] == 6
        await sub.aclose()

    asyncio.run(run())
