"""Real LMCache 0.5.6 cache controller (``lmcache_controller``) + a real CPU-only standalone LMCache worker
(``python -m lmcache.v1.standalone``) that registers with it. The worker binds its reply socket on all
interfaces, so both run in a private network namespace: :func:`run_in_netns` executes a driver script inside
it (under the test venv's python), and the driver uses :class:`ControllerCluster` to start the peers with
``KVTIER_LMCACHE_PYTHON``. The worker's internal API server (``POST /cache/store?tokens_mock=a,b``) is how
the driver puts KV chunks into it. Recipe: reference/vllm-cpu/lmcache_controller_with_worker_netns.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import netns
from .procs import free_port, require_env, start, stop, wait_for


def run_in_netns(script: str, workdir: Path, *args: str, timeout_s: float = 300.0) -> dict[str, Any]:
    require_env("KVTIER_LMCACHE_PYTHON")
    return netns.run_in_netns(sys.executable, script, workdir, *args, timeout_s=timeout_s)


@dataclass
class ControllerCluster:
    """Controller on ``http_port`` + one standalone worker ``instance_id`` (chunk ``chunk_size`` tokens)."""

    workdir: Path
    instance_id: str = "standalone0"
    chunk_size: int = 256  # the controller's /lookup hashes with a hard-coded 256-token chunking
    http_port: int = field(default_factory=free_port)
    pull_port: int = field(default_factory=free_port)
    reply_port: int = field(default_factory=free_port)
    worker_port: int = field(default_factory=free_port)
    api_port_start: int = field(default_factory=free_port)
    controller: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def worker_api(self) -> str:
        """The worker's internal API (port_start + 1 for worker 0)."""
        return f"http://127.0.0.1:{self.api_port_start + 1}"

    def start(self) -> ControllerCluster:
        import httpx

        py = require_env("KVTIER_LMCACHE_PYTHON")
        bindir = str(Path(py).parent)
        clog = self.workdir / "controller.log"
        self.controller = start(
            [
                py,
                str(Path(bindir) / "lmcache_controller"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.http_port),
                "--monitor-ports",
                json.dumps({"pull": self.pull_port, "reply": self.reply_port}),
            ],
            clog,
            env={"PYTHONHASHSEED": "0"},
            new_session=False,
        )
        wait_for(
            lambda: httpx.get(self.url + "/openapi.json", timeout=2).status_code == 200,
            120,
            "lmcache_controller",
            interval_s=0.5,
            proc=self.controller,
            log=clog,
        )
        env = {
            "LMCACHE_ENABLE_CONTROLLER": "True",
            "LMCACHE_LMCACHE_INSTANCE_ID": self.instance_id,
            "LMCACHE_CONTROLLER_PULL_URL": f"127.0.0.1:{self.pull_port}",
            "LMCACHE_CONTROLLER_REPLY_URL": f"127.0.0.1:{self.reply_port}",
            "LMCACHE_LMCACHE_WORKER_PORTS": str(self.worker_port),
            "LMCACHE_CHUNK_SIZE": str(self.chunk_size),
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
            "PYTHONHASHSEED": "0",
            "LMCACHE_INTERNAL_API_SERVER_ENABLED": "True",
            "LMCACHE_INTERNAL_API_SERVER_HOST": "127.0.0.1",
            "LMCACHE_INTERNAL_API_SERVER_PORT_START": str(self.api_port_start),
        }
        wlog = self.workdir / "worker.log"
        self.worker = start(
            [
                py,
                "-m",
                "lmcache.v1.standalone",
                "--model-name",
                "tiny",
                "--kv-shape",
                f"2,2,{self.chunk_size * 4},2,64",
                "--kv-dtype",
                "bfloat16",
                "--device",
                "cpu",
            ],
            wlog,
            env=env,
            new_session=False,
        )

        def registered() -> bool:
            ws = httpx.get(self.url + "/controller/workers", timeout=2).json().get("workers") or []
            return any(w.get("instance_id") == self.instance_id for w in ws)

        wait_for(
            registered, 180, "standalone worker registration", interval_s=0.5, proc=self.worker, log=wlog
        )

        def api_listening() -> bool:
            """The worker registers over ZMQ before its internal API server listens: wait for both."""
            import socket

            try:
                socket.create_connection(("127.0.0.1", self.api_port_start + 1), timeout=2).close()
            except OSError:
                return False
            return True

        wait_for(
            api_listening, 120, "standalone worker internal API", interval_s=0.5, proc=self.worker, log=wlog
        )
        return self

    def store(self, start_tok: int, end_tok: int) -> dict[str, Any]:
        """Store mock tokens ``range(start_tok, end_tok)`` into the worker (its internal API)."""
        import httpx

        r = httpx.post(f"{self.worker_api}/cache/store?tokens_mock={start_tok},{end_tok}", timeout=60)
        return {"status": r.status_code, "body": r.text[:300]}

    def stop(self) -> None:
        stop(self.worker)
        stop(self.controller)
