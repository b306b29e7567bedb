"""KV-event ingestion benchmark: decode + block-index update, block events per second on one core.

Frames are built with the vLLM 0.33 wire format (map-tagged events in an array-like batch, 3 ZMQ frames),
shaped like a steady-state GPU pool: each batch stores a chain of ``--chain`` new blocks (block_size 32, with
token ids, parent = previous chain's tail) and removes as many old blocks, one ``BlockRemoved`` per hash (as
vLLM emits them). Prints the raw msgspec decode rate of the same frames and the ratio, from wall time and from
this process's CPU time (``time.process_time``, less sensitive to other load on a shared machine).

Run: ``python -m bench.kv_ingest`` (options: ``--batches``, ``--chain``, ``--repeat``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from collections.abc import Callable

import msgspec

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import decode_frames
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier


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


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall s, CPU s of this process) for one call."""
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def run(frames: list[list[bytes]], repeat: int) -> dict[str, tuple[float, float]]:
    """Best-of-``repeat`` (wall s, CPU s) for the raw decode and for the ingest path, interleaved."""
    raw = msgspec.msgpack.Decoder()
    best = {"raw": (float("inf"), float("inf")), "ingest": (float("inf"), float("inf"))}

    def decode_only() -> None:
        for f in frames:
            raw.decode(f[2])

    for _ in range(repeat):
        w, c = _timed(decode_only)
        best["raw"] = (min(best["raw"][0], w), min(best["raw"][1], c))
        ing = KvIngestor(BlockIndex(initial_capacity=1 << 16))

        def ingest(ing: KvIngestor = ing) -> None:  # the live path: decode_frames -> apply, then flush
            for f in frames:
                ing.apply("bench", decode_frames(f))
            ing.flush()  # every queued index update is applied inside the timed region

        w, c = _timed(ingest)
        best["ingest"] = (min(best["ingest"][0], w), min(best["ingest"][1], c))
        assert sum(ing.counts["bench"].events.values()) > 0
        idx = ing.index.count_by_tier()[Tier.GPU]
        assert idx == ing.blocks_tracked()["gpu"], (idx, ing.blocks_tracked())  # index agrees with residency
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    frames, n = make_frames(a.batches, a.chain)
    best = run(frames, a.repeat)
    (raw_w, raw_c), (ing_w, ing_c) = best["raw"], best["ingest"]
    print(f"frames: {len(frames)} batches, {n} block events (chain={a.chain}, block_size=32, with token ids)")
    print(f"one core, best of {a.repeat}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'block events/s':34s} {'wall':>12s} {'CPU time':>12s}")
    print(f"{'raw msgspec decode (untyped):':34s} {n / raw_w:12,.0f} {n / raw_c:12,.0f}")
    print(f"{'kvtier ingest (decode + index):':34s} {n / ing_w:12,.0f} {n / ing_c:12,.0f}")
    print(f"{'ratio ingest / raw decode:':34s} {raw_w / ing_w:12.3f} {raw_c / ing_c:12.3f}")
    verdict = {k: "PASS" if n / v >= 500_000 else "FAIL" for k, v in (("wall", ing_w), ("CPU", ing_c))}
    print(f"{'target >= 500,000 block events/s:':34s} {verdict['wall']:>12s} {verdict['CPU']:>12s}")


if __name__ == "__main__":
    main()
