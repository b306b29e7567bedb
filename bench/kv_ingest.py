"""KV-event ingestion benchmark: decode + block-index update, block events per second on one core.

Frames are built with the vLLM 0.33 wire format (map-tagged events in an array-like batch, 3 ZMQ frames),
shaped like a steady-state GPU pool: each batch stores a chain of ``--chain`` new blocks (block_size 32, with
token ids, parent = previous chain's tail) and removes as many old blocks, one ``BlockRemoved`` per hash (as
vLLM emits them). Prints the raw msgspec decode rate of the same frames and the ratio.

Run: ``python -m bench.kv_ingest`` (options: ``--batches``, ``--chain``, ``--repeat``).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import msgspec

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import decode_frames
from kvtier.policies.index import BlockIndex


def make_frames(
    n_batches: int, chain: int, block_size: int = 32, seed: int = 0
) -> tuple[list[list[bytes]], int]:
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    live: list[int] = []
    frames: list[list[bytes]] = []
    parent: int | None = None
    depth = 0
    block_events = 0
    for seq in range(n_batches):
        hashes = [rng.getrandbits(64) for _ in range(chain)]
        events: list[dict[str, object]] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": [rng.randrange(32000) for _ in range(chain * block_size)],
                "block_size": block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
        ]
        block_events += chain
        live.extend(hashes)
        depth = depth + chain if parent is not None else chain
        # continue the prefix (a longer prompt) half of the time, up to 32 blocks deep (1024 tokens)
        parent = hashes[-1] if rng.random() < 0.5 and depth + chain <= 32 else None
        if len(live) > 4 * chain:
            for h in live[:chain]:
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
            block_events += chain
            del live[:chain]
        payload = enc.encode([time.time(), events, 0])
        frames.append([b"kv-events", seq.to_bytes(8, "big"), payload])
    return frames, block_events


def run(frames: list[list[bytes]], block_events: int, repeat: int) -> tuple[float, float]:
    raw = msgspec.msgpack.Decoder()
    best_raw = best_ing = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        for f in frames:
            raw.decode(f[2])
        best_raw = min(best_raw, time.perf_counter() - t0)
        ing = KvIngestor(BlockIndex(initial_capacity=1 << 16))
        gc.collect()
        t0 = time.perf_counter()
        for f in frames:
            ing.apply("bench", decode_frames(f))
        ing.flush()  # every queued index update is applied inside the timed region
        best_ing = min(best_ing, time.perf_counter() - t0)
        assert sum(ing.counts["bench"].events.values()) > 0
        idx = ing.index.count_by_tier()["gpu"]
        assert idx == ing.blocks_tracked()["gpu"], (idx, ing.blocks_tracked())  # index agrees with residency
    return block_events / best_raw, block_events / best_ing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    frames, n = make_frames(a.batches, a.chain)
    raw_rate, ing_rate = run(frames, n, a.repeat)
    print(f"frames: {len(frames)} batches, {n} block events (chain={a.chain}, block_size=32, with token ids)")
    print(f"raw msgspec decode (untyped):      {raw_rate:12,.0f} block events/s")
    print(f"kvtier ingest (decode + index):    {ing_rate:12,.0f} block events/s")
    print(f"ratio ingest / raw decode:         {ing_rate / raw_rate:12.3f}")
    print(f"target >= 500,000 block events/s:  {'PASS' if ing_rate >= 500_000 else 'FAIL'}")


if __name__ == "__main__":
    main()
