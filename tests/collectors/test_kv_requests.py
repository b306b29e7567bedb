"""KV events -> request-shaped accesses (collectors/kv_requests.py), on decoded vLLM-shaped batches."""

from __future__ import annotations

import msgspec

from kvtier.collectors.kv_requests import RequestInferrer
from kvtier.collectors.vllm_events import BlockRemoved, BlockStored, decode_frames

U = 2**64 - 5  # a uint64 hash, folded to int64 in requests


def batch(events: list[object], seq: int = 1) -> list[object]:
    frames = [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([123.0, events, None])]
    return decode_frames(frames).events  # type: ignore[return-value]


def test_parent_chains_hit_reports_and_offload_events() -> None:
    t = [10.0]
    inf = RequestInferrer(clock=lambda: t[0], block_size_tokens=16)
    # request 1 computes a root chain; request 2 extends it (parent = last block of request 1)
    inf.on_events(batch([BlockStored(block_hashes=[1, 2], block_size=16)]))
    t[0] = 9.0  # a clock step back: timestamps stay non-decreasing
    inf.on_events(batch([BlockStored(block_hashes=[3, U], parent_block_hash=2, block_size=16)]))
    # request 3 (report mode full): its hits [1, 2] re-announced, then its new block under 2, in one batch;
    # a CPU-medium store (offload) and a removal are not requests
    inf.on_events(batch([
        BlockStored(block_hashes=[1, 2], block_size=16),
        BlockStored(block_hashes=[7], parent_block_hash=2, block_size=16),
        BlockStored(block_hashes=[3], parent_block_hash=2, block_size=16, medium="CPU"),
        BlockRemoved(block_hashes=[U]),
    ]))  # fmt: skip
    reqs = inf.drain()
    assert [r.hash_ids.tolist() for r in reqs] == [[1, 2], [1, 2, 3, U - 2**64], [1, 2, 7]]
    assert [r.timestamp_ms for r in reqs] == [10_000.0, 10_000.0, 10_000.0]
    assert [r.input_length for r in reqs] == [32, 64, 48] and all(r.output_length == 0 for r in reqs)
    assert inf.drain() == [] and inf.counts["requests"] == 3


def test_bounded_memory_and_queue() -> None:
    inf = RequestInferrer(clock=lambda: 1.0, max_tracked=3, max_pending=2)
    inf.on_events([BlockStored(block_hashes=[1, 2, 3, 4], block_size=16)])  # parent of 1 forgotten
    inf.on_events([BlockStored(block_hashes=[5], parent_block_hash=4, block_size=16)])
    inf.on_events([BlockStored(block_hashes=[6], parent_block_hash=5, block_size=16)])
    reqs = inf.drain()
    assert inf.counts["dropped"] == 1 and len(reqs) == 2  # oldest request dropped, counted
    # 3 links remembered (3->2, 4->3, 5->4): the chain stops at the parent named by the oldest link
    assert reqs[-1].hash_ids.tolist() == [2, 3, 4, 5, 6]


def test_queue_is_bounded_in_blocks_too() -> None:
    """Long chains: the queue keeps at most ``max_pending_blocks`` blocks, dropping the oldest requests
    (counted); the block count follows every enqueue and drain."""
    inf = RequestInferrer(clock=lambda: 1.0, max_pending=100, max_pending_blocks=10)
    inf.on_events([BlockStored(block_hashes=list(range(1, 7)), block_size=16)])  # 6 blocks
    inf.on_events([BlockStored(block_hashes=list(range(11, 15)), block_size=16)])  # +4 = 10: fits
    assert inf.pending_blocks == 10 and inf.counts["dropped"] == 0
    inf.on_events([BlockStored(block_hashes=[21, 22], block_size=16)])  # 12 > 10: the oldest (6) goes
    assert inf.counts["dropped"] == 1 and inf.pending_blocks == 6 and len(inf) == 2
    assert [r.hash_ids.tolist() for r in inf.drain(1)] == [[11, 12, 13, 14]]
    assert inf.pending_blocks == 2
    inf.drain()
    assert inf.pending_blocks == 0 and len(inf) == 0
