"""Coalesced block-index updates over real ZMQ: with ``flush_interval_s`` the receive loop applies queued
events at most that often, and still applies the last ones when the stream goes quiet. Bounded: 20 batches
on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_kv_subscriber import KvEventSubscriber, KvSource
from kvtier.policies.index import BlockIndex
from tests.collectors.test_kv_flood import TOPIC, close_subscriber, frames


class CountingIngestor(KvIngestor):
    """The real ingestor, counting its flushes (the behaviour under test is how often they happen)."""

    def __init__(self) -> None:
        super().__init__(BlockIndex())
        self.flushes = 0

    def flush(self, *, wait: bool = True) -> bool:
        self.flushes += 1
        return super().flush(wait=wait)


async def _paced(interval_s: float, n: int = 20, gap_s: float = 0.01) -> tuple[CountingIngestor, int]:
    """Publish ``n`` batches of 8 blocks, ``gap_s`` apart (the engine's pace); -> (ingestor, flushes seen
    when the index first held every block)."""
    ctx = zmq.asyncio.Context()
    client = httpx.AsyncClient()
    ing = CountingIngestor()
    sub = KvEventSubscriber("kv:paced", "http://127.0.0.1:1", ingestor=ing, client=client,
                            registry=CollectorRegistry(), context=ctx,
                            flush_interval_s=interval_s)  # fmt: skip
    sub.configure((KvSource(0, "tcp://127.0.0.1:0", None, TOPIC.decode()),))
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    task = asyncio.create_task(sub.run())
    pub.connect(sub.socket_endpoint(0))
    assert await pub.poll(10_000) and await pub.recv() == b"\x01" + TOPIC
    for f in frames(n, 8):
        pub.send_multipart(f, copy=False)
        await asyncio.sleep(gap_s)  # the publisher's pace, not a synchronization
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while len(ing.index) < n * 8:  # no new message comes: the due flush must still happen
        assert loop.time() < deadline and not task.done(), (len(ing.index), ing.queued_ops)
        await asyncio.sleep(0.01)  # polling interval of a condition with a deadline
    seen = ing.flushes
    await close_subscriber(task, pub, sub, client, ctx)
    return ing, seen


def test_flushes_are_coalesced_and_the_tail_is_applied_when_the_stream_goes_quiet() -> None:
    ing, flushes = asyncio.run(_paced(0.5))
    assert ing.queued_ops == 0
    # 20 messages over >= 0.2 s with at most one flush per 0.5 s (the first one comes at once)
    assert 1 <= flushes <= 3, flushes


def test_interval_zero_flushes_after_every_message() -> None:
    _, flushes = asyncio.run(_paced(0.0))
    assert flushes >= 10, flushes  # one per received message (two may arrive in one poll)
