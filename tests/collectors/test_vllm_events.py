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
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_frames,
    decode_payload,
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
    ts, evs, dp, skipped = decode_payload(enc.encode([1.0, [stored([1]), {"type": "BlockStored",
                                                     "block_hashes": "nope"}, ["BlockRemoved", [1], 5]], None]))  # fmt: skip  # noqa: E501
    assert len(evs) == 1 and skipped == 2 and dp is None


def test_refcount_across_engines_and_restart_clear() -> None:
    ing = KvIngestor()
    ing.apply_events("a", decode_payload(enc.encode([0, [stored([1, 2])]]))[1], 0.0)
    ing.apply_events("b", decode_payload(enc.encode([0, [stored([2, 3])]]))[1], 0.0)
    assert ing.blocks_tracked()["gpu"] == 3
    ing.apply_events("a", [BlockRemoved(block_hashes=[2], medium="GPU")], 1.0)
    # b still holds 2
    assert ing.blocks_tracked()["gpu"] == 3 and Tier.GPU in ing.flushed_index().get(2).tiers
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
    src = KvSource(0, "tcp://127.0.0.1:1", f"tcp://127.0.0.1:{rport}" if replay else None, "kv")
    sub._configure((src,))
    buffered = {s: frames(s, [stored([100 + s])]) for s in range(5)}

    async def serve_replay() -> None:
        cid, _, start = await router.recv_multipart()
        for s in range(int.from_bytes(start, "big"), 5):
            await router.send_multipart([cid, b"", *buffered[s]])
        await router.send_multipart([cid, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    task = asyncio.create_task(serve_replay()) if replay else None
    await sub.handle(0, buffered[0])
    await sub.handle(0, buffered[4])  # 1..3 missing
    if task is not None:
        await task
    await sub.handle(0, frames(0, [stored([999])]))  # sequence went back: publisher restarted
    await sub.aclose()
    router.close(linger=0)
    ctx.term()
    return sub


def test_gap_filled_from_replay() -> None:
    sub = asyncio.run(_gap_scenario(replay=True))
    assert sub.replayed == 3 and sub.lost == 0 and sub.ingestor.counts[sub.engine].blocks_stored == 6
    assert sub.ingestor.blocks_tracked()["gpu"] == 1  # the restart dropped the old process's blocks


def test_gap_without_replay_counted_lost() -> None:
    sub = asyncio.run(_gap_scenario(replay=False))
    assert sub.lost == 3 and sub.replayed == 0
    assert sub.ingestor.blocks_tracked()["gpu"] == 1
