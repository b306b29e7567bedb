"""`bench.live_ab --l1-chunks`: L1 sized in chunks of the served model, through its KV bytes per chunk."""

from __future__ import annotations

import json
from pathlib import Path

from bench.live_ab import kv_bytes_per_chunk


def _model(tmp_path: Path, **cfg: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_kv_bytes_per_chunk_matches_what_lmcache_holds_for_the_tiny_model(tmp_path: Path) -> None:
    # the default test model: 2 layers, 2 KV heads of 64 dims, bf16 -> 64 KiB per 64-token chunk, the size
    # LMCache MP reported for it (0.028 GiB of L1 held 458 chunks)
    tiny = _model(
        tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2
    )
    assert kv_bytes_per_chunk(tiny) == 64 * 1024
    assert int(0.028 * 2**30 // kv_bytes_per_chunk(tiny)) == 458


def test_kv_bytes_per_chunk_counts_kv_heads_not_query_heads(tmp_path: Path) -> None:
    gqa = _model(
        tmp_path, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32
    )
    assert kv_bytes_per_chunk(gqa, chunk_tokens=256) == 2 * 32 * 8 * 128 * 2 * 256  # 32 MiB, Llama-3-8B-like
