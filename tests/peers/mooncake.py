"""Real Mooncake Store (``mooncake-transfer-engine-non-cuda``): master + two TCP clients in a private network
namespace (``unshare -n``; the master's metadata server and the clients' transfer engines bind 0.0.0.0).

Processes inside the namespace are unreachable from outside, so the test driver runs inside it too:
:func:`run_in_netns` executes ``tests/peers/scripts/<script>`` under ``KVTIER_MOONCAKE_PYTHON`` inside a
fresh namespace and returns the JSON the script prints on its ``RESULT`` line. Inside,
:class:`MooncakeCluster`
starts the master and the second ("hold") client. Recipe: reference/feasibility_cachelayers.md §3.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import netns
from .procs import free_port, require_env, start, stop, wait_for

HERE = Path(__file__).resolve().parent


def run_in_netns(script: str, workdir: Path, *args: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``tests/peers/scripts/<script>`` under KVTIER_MOONCAKE_PYTHON in a private network namespace."""
    return netns.run_in_netns(
        require_env("KVTIER_MOONCAKE_PYTHON"),
        script,
        workdir,
        *args,
        timeout_s=timeout_s,
        env={"LD_LIBRARY_PATH": require_env("KVTIER_MOONCAKE_LIBDIR"), "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )


@dataclass
class MooncakeCluster:
    """Master (HTTP metadata server on) + a "hold" client contributing segment ``hold_segment``.
    Must be used inside the namespace; children share the caller's process group."""

    workdir: Path
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    meta_port: int = field(default_factory=free_port)
    hold_port: int = field(default_factory=free_port)
    lease_ttl_ms: int = 2000
    master: subprocess.Popen[bytes] | None = None
    hold: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    @property
    def hold_segment(self) -> str:
        return f"127.0.0.1:{self.hold_port}"

    def start(self) -> MooncakeCluster:
        import httpx
        import mooncake

        master_bin = str(Path(mooncake.__file__).parent / "mooncake_master")
        log = self.workdir / "master.log"
        self.master = start(
            [
                master_bin,
                "-rpc_address=127.0.0.1",
                f"-rpc_port={self.rpc_port}",
                "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.meta_port}",
                f"-default_kv_lease_ttl={self.lease_ttl_ms}",
                "-logtostderr",
            ],
            log,
            new_session=False,
        )
        wait_for(
            lambda: httpx.get(self.admin_url + "/health", timeout=2).status_code == 200,
            30,
            "mooncake master",
            proc=self.master,
            log=log,
        )
        ready = self.workdir / "hold.ready"
        ready.unlink(missing_ok=True)
        hlog = self.workdir / "hold.log"
        self.hold = start(
            [
                sys.executable,
                str(HERE / "scripts" / "mooncake_hold.py"),
                self.hold_segment,
                self.metadata_url,
                self.master_addr,
                str(ready),
            ],
            hlog,
            new_session=False,
        )
        wait_for(ready.exists, 60, "mooncake hold client", proc=self.hold, log=hlog)
        return self

    def client(self, name: str) -> Any:
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup(name, self.metadata_url, 64 << 20, 16 << 20, "tcp", "", self.master_addr)
        if rc != 0:
            raise RuntimeError(f"mooncake client setup({name}) returned {rc}")
        return s

    def stop(self) -> None:
        stop(self.hold)
        stop(self.master)
