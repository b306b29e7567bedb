"""Real reads on a real block device, for the storage panels' read-latency queries.

The storage collector reports the average latency per read completed in its window, so that panel is empty
(by design: no read, no latency) on a host whose working set sits in the page cache, as a CI container's
often does. Tests that need the panel filled make the device read instead of faking the collector.
"""

from __future__ import annotations

import os
import random
from pathlib import Path


def cold_reads(path: Path, mib: int = 8) -> int:
    """Read ``mib`` MiB from the block device under ``path``: write and fsync a file, drop its pages from the
    page cache (``posix_fadvise DONTNEED``), read it back. Returns the bytes read; the file is removed."""
    chunk = random.Random(mib).randbytes(1 << 20)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = 0
        while b := os.read(fd, 1 << 20):
            n += len(b)
        return n
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
