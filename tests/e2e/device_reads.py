"""Real reads on a real block device, for the storage panels' read-latency queries.

The storage collector reports the average latency per read completed in its window, so that panel is empty
(by design: no read, no latency) on a host whose working set sits in the page cache, as a CI container's
often does. Tests that need the panel filled make the device read instead of faking the collector.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from tests.e2e import prom as promlib
from tests.peers.procs import wait_for


def cold_reads(path: Path, mib: int = 8) -> int:
    """Read ``mib`` MiB from the block device under ``path``: write and fsync a file, drop its pages from the
    page cache (``posix_fadvise DONTNEED``), read it back. Returns the bytes read; the file is removed."""
    chunk = random.Random(mib).randbytes(1 << 20)
    try:
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
    finally:
        path.unlink(missing_ok=True)


def read_until_the_collector_saw_reads(prometheus: promlib.Prometheus, directory: Path) -> None:
    """Make cold reads next to ``directory`` until Prometheus holds the sidecar's read-latency series (its
    gauge keeps the last window's value, so one window with reads is enough); at most 120 s."""
    wait_for(
        lambda: (
            cold_reads(directory / "cold-read.bin")
            and prometheus.query("count(kvtier_storage_device_read_latency_milliseconds)")
        ),
        120,
        "device reads seen by the storage collector",
        interval_s=1.0,
    )
