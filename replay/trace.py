"""Mooncake trace reader: JSONL (maybe gzipped) of ``{timestamp, input_length, output_length, hash_ids}``.

Streams line by line, so files of any size work; a malformed line raises :class:`TraceError` naming the
file, the 1-based line number and what is wrong. Block ids may be any 64-bit integers: ids >= 2**63
(vLLM's uint64 block hashes) are mapped to int64 by two's complement, so equal ids stay equal.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import IO, cast

import msgspec
import numpy as np

from kvtier.policies.base import Request

DEFAULT_BLOCK_TOKENS = 512
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class TraceError(ValueError):
    """A trace line that cannot be read; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str, line: int, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}")
        self.path = path
        self.line = line
        self.what = what


class _Record(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(_Record)


def bundled_trace_path() -> Path:
    """Path of the Mooncake conversation trace shipped with kvtier (12,031 requests, gzipped)."""
    return Path(str(resources.files("kvtier.replay").joinpath("data/conversation_trace.jsonl.gz")))


def _open(path: Path) -> IO[bytes]:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def _to_int64(ids: list[int], path: str, lineno: int) -> np.ndarray:
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:
        pass
    out = []
    for i, h in enumerate(ids):
        if h < -(1 << 63) or h >= _U64:
            raise TraceError(path, lineno, f"hash_ids[{i}] = {h} does not fit in 64 bits")
        out.append(h - _U64 if h > _I64_MAX else h)
    return np.asarray(out, dtype=np.int64)


def parse_line(raw: bytes, *, path: str = "<string>", lineno: int = 1, block_tokens: int = 512) -> Request:
    """Parse one JSONL line into a :class:`Request` or raise :class:`TraceError`."""
    try:
        rec = _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise TraceError(path, lineno, f"invalid record: {e}") from None
    except msgspec.DecodeError as e:
        raise TraceError(path, lineno, f"not valid JSON: {e}") from None
    if rec.input_length < 0:
        raise TraceError(path, lineno, f"input_length must be >= 0, got {rec.input_length}")
    if rec.output_length < 0:
        raise TraceError(path, lineno, f"output_length must be >= 0, got {rec.output_length}")
    if rec.timestamp < 0 or rec.timestamp != rec.timestamp:
        raise TraceError(path, lineno, f"timestamp must be a non-negative number of ms, got {rec.timestamp}")
    max_blocks = -(-rec.input_length // block_tokens)
    if len(rec.hash_ids) > max_blocks:
        raise TraceError(
            path,
            lineno,
            f"{len(rec.hash_ids)} hash_ids but input_length {rec.input_length} spans only {max_blocks} "
            f"blocks of {block_tokens} tokens",
        )
    ids = _to_int64(rec.hash_ids, path, lineno)
    return Request(
        timestamp_ms=float(rec.timestamp),
        input_length=int(rec.input_length),
        output_length=int(rec.output_length),
        hash_ids=ids,
        block_tokens=block_tokens,
    )


def iter_trace(
    path: str | Path, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_requests: int | None = None
) -> Iterator[Request]:
    """Yield the trace's requests in file order (blank lines are skipped)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    p = Path(path)
    name = str(p)
    n = 0
    with _open(p) as fh:
        for lineno, raw in enumerate(fh, start=1):
            if max_requests is not None and n >= max_requests:
                return
            if not raw.strip():
                continue
            try:
                yield parse_line(raw, path=name, lineno=lineno, block_tokens=block_tokens)
            except UnicodeDecodeError as e:
                raise TraceError(name, lineno, f"not UTF-8: {e}") from None
            n += 1


def load_trace(
    path: str | Path, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_requests: int | None = None
) -> list[Request]:
    """Read a whole trace (or its first ``max_requests`` requests) into a list."""
    return list(iter_trace(path, block_tokens=block_tokens, max_requests=max_requests))


def distinct_blocks(requests: list[Request]) -> int:
    """Number of distinct block ids in ``requests``."""
    if not requests:
        return 0
    return int(np.unique(np.concatenate([r.hash_ids for r in requests])).size)
