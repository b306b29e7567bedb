"""Trace reader: happy path, gzip, uint64 ids, streaming, and malformed lines (file, line, what)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.replay.trace import TraceError, bundled_trace_path, iter_trace, load_trace

GOOD = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 12, "input_length": 512, "output_length": 1, "hash_ids": [1]},
]


def write(tmp: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    p = tmp / name
    data = ("\n".join(lines) + "\n").encode()
    p.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return p


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_reads_plain_and_gzip(tmp_path: Path, name: str) -> None:
    p = write(tmp_path, [json.dumps(r) for r in GOOD] + [""], name)
    reqs = load_trace(p)
    assert len(reqs) == 2
    assert reqs[0].hash_ids.dtype == np.int64 and reqs[0].hash_ids.tolist() == [1, 2]
    assert reqs[1].timestamp_ms == 12.0 and reqs[1].input_length == 512 and reqs[1].block_tokens == 512


def test_block_tokens_and_max_requests(tmp_path: Path) -> None:
    p = write(tmp_path, [json.dumps(r) for r in GOOD])
    assert len(load_trace(p, max_requests=1)) == 1
    assert load_trace(p, block_tokens=500)[0].block_tokens == 500
    with pytest.raises(TraceError, match="spans only 1 blocks of 1024"):
        load_trace(p, block_tokens=1024)  # line 1: 1000 tokens cannot fill 2 blocks of 1024
    with pytest.raises(ValueError, match="block_tokens"):
        load_trace(p, block_tokens=0)


def test_uint64_ids_fold(tmp_path: Path) -> None:
    big = (1 << 64) - 1
    p = write(
        tmp_path,
        [json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [big, 3]})],
    )
    (r,) = load_trace(p)
    assert r.hash_ids.tolist() == [-1, 3]


def test_streams_lazily(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD[0])] * 3 + ["{broken"]
    it = iter_trace(write(tmp_path, lines))
    assert next(it).input_length == 1000  # the broken line 4 is not read yet
    with pytest.raises(TraceError):
        list(it)


BAD = [
    ("{broken", "not valid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', "input_length must be >= 0"),
    ('{"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "spans only 1 blocks"),
    (
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 18446744073709551616]}',
        "64",
    ),
    ("[1, 2]", "invalid record"),
]


@pytest.mark.parametrize(("line", "what"), BAD)
def test_malformed_lines_name_file_line_and_problem(tmp_path: Path, line: str, what: str) -> None:
    p = write(tmp_path, [json.dumps(GOOD[0]), "", line])
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    e = ei.value
    assert e.path == str(p) and e.line == 3
    assert str(e).startswith(f"{p}:3: ") and what in str(e)


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(TraceError, match=r":2: "):
        load_trace(p)


def test_bundled_trace_present() -> None:
    p = bundled_trace_path()
    assert p.exists() and p.stat().st_size < 1_000_000
    assert next(iter_trace(p)).hash_ids.size > 0
