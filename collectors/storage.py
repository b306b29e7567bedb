"""Storage telemetry: block devices (/proc/diskstats), tier path capacity, NVMe / NVMe-oF (sysfs), GDS
counters.

All paths are read under an injected ``root`` (default ``/``) so tests can point it at canned trees
(``tests/data/storage/...``). Parsing is pure (:func:`parse_diskstats`, :func:`parse_gds_stats`); rates come
from two successive samples. Units: bytes, bytes/s, IO/s, milliseconds, ratio 0..1.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtier.collectors.base import Clock, Collector, Observation

NVME_STATES = ("live", "connecting", "resetting", "deleting", "dead", "unknown")
SECTOR = 512  # /proc/diskstats sectors are always 512 bytes


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """Cumulative /proc/diskstats fields of one device."""

    reads: int
    read_bytes: int
    read_ms: int
    writes: int
    write_bytes: int
    write_ms: int
    in_flight: int
    io_ms: int  # time spent doing I/O (ms) -> utilisation
    weighted_io_ms: int  # -> average queue depth


@dataclass(frozen=True, slots=True)
class DeviceSample:
    device: str
    read_bytes_total: int
    write_bytes_total: int
    read_bytes_per_s: float | None
    write_bytes_per_s: float | None
    read_iops: float | None
    write_iops: float | None
    avg_read_latency_ms: float | None  # per completed read in the window
    avg_write_latency_ms: float | None
    utilization: float | None  # 0..1 busy fraction in the window
    queue_depth: float | None  # average in-queue requests in the window
    in_flight: int


@dataclass(frozen=True, slots=True)
class PathUsage:
    tier: str
    path: str
    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class NvmeController:
    name: str  # nvme0
    transport: str  # pcie / tcp / rdma / fc / loop
    state: str  # live / connecting / ...
    model: str
    address: str
    subsystem_nqn: str
    paths: tuple[str, ...]  # namespace / multipath path devices (nvme0c0n1, ...)


@dataclass(frozen=True, slots=True)
class StorageObservation(Observation):
    devices: tuple[DeviceSample, ...]
    paths: tuple[PathUsage, ...]
    nvme: tuple[NvmeController, ...]
    gds: dict[str, float] | None  # nvidia-fs counters, None when the driver is absent


def parse_diskstats(text: str) -> dict[str, DiskCounters]:
    """Pure: /proc/diskstats -> counters per device (lines with < 14 fields are skipped)."""
    out: dict[str, DiskCounters] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 14:
            continue
        try:
            v = [int(x) for x in f[3:14]]
        except ValueError:
            continue
        out[f[2]] = DiskCounters(
            reads=v[0], read_bytes=v[2] * SECTOR, read_ms=v[3], writes=v[4], write_bytes=v[6] * SECTOR,
            write_ms=v[7], in_flight=v[8], io_ms=v[9], weighted_io_ms=v[10],
        )  # fmt: skip
    return out


def parse_gds_stats(text: str) -> dict[str, float]:
    """Pure: /proc/driver/nvidia-fs/stats ``Key: value`` lines (and ``Ops: Read=1 Write=2``) -> numbers."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        key, _, rest = line.partition(":")
        key = key.strip().lower().replace(" ", "_").replace("-", "_")
        rest = rest.strip()
        if "=" in rest:
            for part in rest.split():
                k, _, v = part.partition("=")
                try:
                    out[f"{key}_{k.strip().lower()}"] = float(v.rstrip(","))
                except ValueError:
                    continue
        else:
            try:
                out[key] = float(rest.split()[0]) if rest else 0.0
            except ValueError:
                continue
    return out


def device_rates(cur: DiskCounters, prev: DiskCounters | None, dt: float | None, name: str) -> DeviceSample:
    """Pure: window rates from two cumulative samples ``dt`` seconds apart (None on the first)."""
    if prev is None or not dt or dt <= 0 or cur.reads < prev.reads or cur.writes < prev.writes:
        return DeviceSample(name, cur.read_bytes, cur.write_bytes, None, None, None, None, None, None, None,
                            None, cur.in_flight)  # fmt: skip
    dr, dw = cur.reads - prev.reads, cur.writes - prev.writes
    return DeviceSample(
        device=name,
        read_bytes_total=cur.read_bytes,
        write_bytes_total=cur.write_bytes,
        read_bytes_per_s=(cur.read_bytes - prev.read_bytes) / dt,
        write_bytes_per_s=(cur.write_bytes - prev.write_bytes) / dt,
        read_iops=dr / dt,
        write_iops=dw / dt,
        avg_read_latency_ms=(cur.read_ms - prev.read_ms) / dr if dr else None,
        avg_write_latency_ms=(cur.write_ms - prev.write_ms) / dw if dw else None,
        utilization=min(1.0, (cur.io_ms - prev.io_ms) / (dt * 1000.0)),
        queue_depth=(cur.weighted_io_ms - prev.weighted_io_ms) / (dt * 1000.0),
        in_flight=cur.in_flight,
    )


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def read_nvme(root: Path) -> tuple[NvmeController, ...]:
    """NVMe controllers from ``<root>/sys/class/nvme`` (+ paths/namespaces, NVMe-oF transport/address)."""
    base = root / "sys/class/nvme"
    if not base.is_dir():
        return ()
    out = []
    for c in sorted(base.iterdir()):
        paths = tuple(sorted(p.name for p in c.iterdir() if p.name.startswith(c.name) and p.name != c.name)) \
            if c.is_dir() else ()  # fmt: skip
        out.append(
            NvmeController(
                name=c.name,
                transport=_read(c / "transport"),
                state=_read(c / "state"),
                model=_read(c / "model"),
                address=_read(c / "address"),
                subsystem_nqn=_read(c / "subsysnqn"),
                paths=paths,
            )  # fmt: skip
        )
    return tuple(out)


class StorageCollector(Collector[dict[str, object], StorageObservation]):
    """Devices, tier paths, NVMe(-oF) and GDS under ``root``; exports ``kvtier_storage_*`` metrics."""

    kind = "storage"

    def __init__(
        self,
        name: str = "storage",
        *,
        registry: CollectorRegistry,
        clock: Clock = time.time,
        root: str | Path = "/",
        tier_paths: dict[str, str] | None = None,
        devices: Sequence[str] | None = None,  # None: every device except loop/ram
    ) -> None:
        super().__init__(name, registry=registry, clock=clock)
        self.root = Path(root)
        self.tier_paths = dict(tier_paths or {})
        self.devices = set(devices) if devices is not None else None
        self._prev: dict[str, DiskCounters] = {}
        self._prev_t: float | None = None
        self._last_bytes: dict[tuple[str, str], int] = {}
        lbl = ["device"]
        self.m_read = Counter(
            "kvtier_storage_device_read_bytes", "Bytes read from the device.", lbl, registry=registry
        )
        self.m_write = Counter(
            "kvtier_storage_device_write_bytes", "Bytes written to the device.", lbl, registry=registry
        )
        self.g = {
            k: Gauge(f"kvtier_storage_device_{k}", h, lbl, registry=registry)
            for k, h in {
                "read_bytes_per_second": "Read throughput over the last window, bytes/s.",
                "write_bytes_per_second": "Write throughput over the last window, bytes/s.",
                "read_iops": "Completed reads per second over the last window.",
                "write_iops": "Completed writes per second over the last window.",
                "read_latency_milliseconds": "Average read latency over the last window, ms.",
                "write_latency_milliseconds": "Average write latency over the last window, ms.",
                "utilization_ratio": "Busy fraction over the last window, 0..1.",
                "queue_depth": "Average requests in queue over the last window.",
            }.items()
        }
        self.g_path = Gauge("kvtier_storage_path_bytes", "Capacity of a tier path, bytes.",
                            ["tier", "path", "kind"],
                            registry=registry)  # fmt: skip
        self.g_nvme = Gauge("kvtier_storage_nvme_controller_live", "1 if the NVMe controller state is live.",
                            ["controller", "transport"], registry=registry)  # fmt: skip
        # contract name (dashboards/METRICS.md): controller paths per state, every state created at 0
        self.g_nvme_paths = Gauge("kvtier_storage_nvme_paths", "NVMe / NVMe-oF controller paths by state.",
                                  ["state"], registry=registry)  # fmt: skip
        for st in NVME_STATES:
            self.g_nvme_paths.labels(state=st).set(0)
        self.g_gds = Gauge("kvtier_storage_gds_stat", "nvidia-fs (GPUDirect Storage) counter.", ["stat"],
                           registry=registry)  # fmt: skip

    async def fetch(self) -> dict[str, object]:
        raw: dict[str, object] = {"diskstats": (self.root / "proc/diskstats").read_text()}
        gds = self.root / "proc/driver/nvidia-fs/stats"
        raw["gds"] = _read(gds) if gds.exists() else None
        usage = {}
        for tier, path in self.tier_paths.items():
            p = Path(path) if self.root == Path("/") else self.root / path.lstrip("/")
            try:
                u = shutil.disk_usage(p)
                usage[tier] = (path, u.total, u.used, u.free)
            except OSError as exc:
                self.count_error("tier_path", f"{tier}={path}: {exc}")
        raw["usage"] = usage
        raw["nvme"] = read_nvme(self.root)
        return raw

    def _wanted(self, dev: str) -> bool:
        if self.devices is not None:
            return dev in self.devices
        return not dev.startswith(("loop", "ram", "zram"))

    def parse(self, raw: dict[str, object], now: float) -> StorageObservation:
        stats = parse_diskstats(str(raw["diskstats"]))
        dt = now - self._prev_t if self._prev_t is not None else None
        devs = tuple(
            device_rates(c, self._prev.get(d), dt, d) for d, c in sorted(stats.items()) if self._wanted(d)
        )
        self._prev, self._prev_t = stats, now
        usage = raw["usage"]
        assert isinstance(usage, dict)
        paths = tuple(PathUsage(t, p, tot, used, free) for t, (p, tot, used, free) in sorted(usage.items()))
        gds_text = raw.get("gds")
        gds = parse_gds_stats(gds_text) if isinstance(gds_text, str) else None
        nvme = raw["nvme"]
        assert isinstance(nvme, tuple)
        obs = StorageObservation(self.name, now, devs, paths, nvme, gds)
        self._export(obs)
        return obs

    def _export(self, obs: StorageObservation) -> None:
        for d in obs.devices:
            pairs = (("read", self.m_read, d.read_bytes_total), ("write", self.m_write, d.write_bytes_total))
            for op, m, total in pairs:
                key = (op, d.device)
                last = self._last_bytes.get(key)
                inc = total if last is None or total < last else total - last
                if inc:
                    m.labels(device=d.device).inc(inc)
                else:
                    m.labels(device=d.device)
                self._last_bytes[key] = total
            for k, v in (
                ("read_bytes_per_second", d.read_bytes_per_s),
                ("write_bytes_per_second", d.write_bytes_per_s),
                ("read_iops", d.read_iops), ("write_iops", d.write_iops),
                ("read_latency_milliseconds", d.avg_read_latency_ms),
                ("write_latency_milliseconds", d.avg_write_latency_ms),
                ("utilization_ratio", d.utilization), ("queue_depth", d.queue_depth),
            ):  # fmt: skip
                if v is not None:
                    self.g[k].labels(device=d.device).set(v)
        for p in obs.paths:
            for kind, v in (("total", p.total_bytes), ("used", p.used_bytes), ("free", p.free_bytes)):
                self.g_path.labels(tier=p.tier, path=p.path, kind=kind).set(v)
        for c in obs.nvme:
            self.g_nvme.labels(controller=c.name, transport=c.transport).set(1 if c.state == "live" else 0)
        counts = dict.fromkeys(NVME_STATES, 0)
        for c in obs.nvme:
            st = c.state if c.state in counts else "unknown"
            counts[st] += 1  # one controller = one path of its subsystem
        for st, n in counts.items():
            self.g_nvme_paths.labels(state=st).set(n)
        for k, v in (obs.gds or {}).items():
            self.g_gds.labels(stat=k).set(v)


def default_root() -> str:
    return os.environ.get("KVTIER_STORAGE_ROOT", "/")
