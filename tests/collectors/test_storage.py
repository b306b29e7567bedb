"""Storage collector on this machine's real /proc (and real disk usage of a tmp dir), and on a canned
sysfs/proc
tree (tests/data/storage/nvmeof) for NVMe-oF controllers and GDS counters this machine does not have."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvtier.collectors.storage import StorageCollector, device_rates, parse_diskstats

DATA = Path(__file__).resolve().parents[1] / "data" / "storage" / "nvmeof"


def test_real_proc_diskstats_and_tier_path(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    t = iter([100.0, 101.0])
    c = StorageCollector(registry=reg, clock=lambda: next(t), tier_paths={"disk": str(tmp_path)})
    o1 = asyncio.run(c.poll())
    (tmp_path / "blob").write_bytes(b"x" * 1_000_000)
    o2 = asyncio.run(c.poll())
    assert o1 is not None and o2 is not None, c.health
    real = parse_diskstats(Path("/proc/diskstats").read_text())
    assert {d.device for d in o2.devices} <= set(real) and o2.devices
    assert all(not d.device.startswith("loop") for d in o2.devices)
    d = o2.devices[0]
    assert d.read_bytes_per_s is not None and d.read_bytes_per_s >= 0 and 0 <= (d.utilization or 0) <= 1
    assert (
        reg.get_sample_value("kvtier_storage_device_read_bytes_total", {"device": d.device})
        == d.read_bytes_total
    )
    du = shutil.disk_usage(tmp_path)
    (p,) = o2.paths
    assert p.tier == "disk" and p.total_bytes == du.total
    assert o2.gds is None  # no nvidia-fs here


def test_canned_nvmeof_tree_and_gds() -> None:
    reg = CollectorRegistry()
    c = StorageCollector(registry=reg, clock=lambda: 5.0, root=DATA)
    o = asyncio.run(c.poll())
    assert o is not None, c.health
    assert [d.device for d in o.devices] == ["nvme0n1", "nvme1n1"]
    assert o.devices[0].read_bytes_total == 8000 * 512
    n0, n1 = o.nvme
    assert (n0.name, n0.transport, n0.state, n0.paths) == ("nvme0", "tcp", "live", ("nvme0c0n1",))
    assert "traddr=10.0.0.5" in n0.address
    assert (n1.transport, n1.state) == ("pcie", "connecting")
    assert o.gds is not None and o.gds["ops_read"] == 1200 and o.gds["bytes_write"] == 1228800
    assert (
        reg.get_sample_value(
            "kvtier_storage_nvme_controller_live", {"controller": "nvme0", "transport": "tcp"}
        )
        == 1
    )
    assert reg.get_sample_value("kvtier_storage_gds_stat", {"stat": "ops_write"}) == 300


def test_rates_from_two_samples() -> None:
    a = parse_diskstats(" 8 0 sda 100 0 800 50 10 0 80 20 1 100 200 0 0 0 0")["sda"]
    b = parse_diskstats(" 8 0 sda 200 0 1800 150 20 0 180 40 3 600 1200 0 0 0 0")["sda"]
    r = device_rates(b, a, 2.0, "sda")
    assert r.read_bytes_per_s == 1000 * 512 / 2 and r.read_iops == 50 and r.avg_read_latency_ms == 1.0
    assert r.write_iops == 5 and r.avg_write_latency_ms == 2.0
    assert r.utilization == 0.25 and r.queue_depth == 0.5 and r.in_flight == 3
    assert device_rates(a, b, 2.0, "sda").read_iops is None  # counters went back (device reset): no rate


def test_missing_proc_is_a_counted_failure(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    c = StorageCollector(registry=reg, root=tmp_path)
    assert asyncio.run(c.poll()) is None
    assert not c.health.up and "diskstats" in (c.health.last_error or "")
    assert reg.get_sample_value("kvtier_collector_errors_total", {"collector": "storage"}) == 1
