"""Real LMCache 0.5.6 MP server (L1 DRAM + fs L2) and vLLM CPU + LMCacheMPConnector, on free 127.0.0.1 ports.

Recipe: /work/shared/reference/feasibility_cachelayers.md §1-2. ``KVTIER_LMCACHE_PYTHON`` /
``KVTIER_VLLM_PYTHON`` / ``KVTIER_TINY_MODEL`` come from the peers' env.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .procs import free_port, require_env, start, stop, wait_started

HERE = Path(__file__).resolve().parent


@dataclass
class LMCacheMPServer:
    """``lmcache server`` with ``--chunk-size`` tokens per chunk; L2 files under ``workdir/l2``."""

    workdir: Path
    chunk_size: int = 64
    l1_gb: float = 0.25
    zmq_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def zmq_url(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def l2_dir(self) -> Path:
        return self.workdir / "l2"

    @property
    def log(self) -> Path:
        return self.workdir / "mp_server.log"

    def start(self, stall_s: float = 120.0) -> LMCacheMPServer:
        """Start; wait for ``/healthcheck``, failing after ``stall_s`` s without progress (or the cap)."""
        py = require_env("KVTIER_LMCACHE_PYTHON")
        self.workdir.mkdir(parents=True, exist_ok=True)
        l1 = str(int(self.l1_gb)) if float(self.l1_gb).is_integer() else str(self.l1_gb)
        cmd = [
            py,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.zmq_port),
            "--chunk-size",
            str(self.chunk_size),
            "--l1-size-gb",
            l1,
            "--l1-init-size-gb",
            "0",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
            "--l2-adapter",
            json.dumps({"type": "fs", "base_path": str(self.l2_dir)}),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--max-workers",
            "2",
        ]
        self.proc = start(cmd, self.log)
        wait_started(
            lambda: httpx.get(self.url + "/healthcheck", timeout=2).status_code == 200,
            "LMCache MP server",
            proc=self.proc,
            log=self.log,
            stall_s=stall_s,
        )
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def status(self) -> dict[str, object]:
        return dict(httpx.get(self.url + "/status", timeout=5).json())

    def l1_objects(self) -> int:
        st = self.status()["storage_manager"]
        return int(st["l1_managers"]["_default"]["total_object_count"])  # type: ignore[index]

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text


@dataclass
class FakeEngine:
    """LMCache's own worker adapter with CPU tensors (no vLLM): stores seeded chunks and stays registered
    (the HTTP prefetch needs a registered layout). ``model`` is the LMCache model_name."""

    server: LMCacheMPServer
    seed: int = 0
    tokens: int = 256
    model: str = "tiny"
    sequences: int = 1  # seeded sequences stored: seed, seed+1, ...
    pace_s: float = 0.0  # seconds between sequences
    proc: subprocess.Popen[bytes] | None = None
    result: dict[str, object] = field(default_factory=dict)

    def start(self, stall_s: float = 120.0) -> FakeEngine:
        py = require_env("KVTIER_LMCACHE_PYTHON")
        out = self.server.workdir / f"fake_engine_{self.seed}.out"
        out.unlink(missing_ok=True)
        self.proc = start(
            [
                py,
                str(HERE / "scripts" / "lmcache_fake_engine.py"),
                "--url",
                self.server.zmq_url,
                "--model",
                self.model,
                "--seed",
                str(self.seed),
                "--tokens",
                str(self.tokens),
                "--sequences",
                str(self.sequences),
                "--pace-s",
                str(self.pace_s),
                "--out",
                str(out),
            ],
            self.server.workdir / f"fake_engine_{self.seed}.log",
        )
        self.result = wait_started(
            lambda: json.loads(out.read_text()) if out.exists() else None,
            "fake LMCache engine",
            proc=self.proc,
            log=self.server.workdir / f"fake_engine_{self.seed}.log",
            stall_s=stall_s,
        )
        return self

    @property
    def token_ids(self) -> list[int]:
        return list(self.result["token_ids"])  # type: ignore[call-overload]

    @property
    def all_token_ids(self) -> list[list[int]]:
        return [list(t) for t in self.result["all_token_ids"]]  # type: ignore[attr-defined]

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None


@dataclass
class VllmWithLMCache:
    """vLLM CPU (tiny model, block 32, 48-block pool) with LMCacheMPConnector to ``server``."""

    server: LMCacheMPServer
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    served_name: str = "tiny"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_path(self) -> str:
        """LMCache keys use the model *path* as model_name."""
        return require_env("KVTIER_TINY_MODEL")

    @property
    def log(self) -> Path:
        return self.server.workdir / "vllm.log"

    def start(self, stall_s: float = 300.0) -> VllmWithLMCache:
        py = require_env("KVTIER_VLLM_PYTHON")
        kvt = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.server.zmq_port,
                "lmcache.mp.mq_timeout": 30,
            },
        }
        cmd = [
            py,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_name,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "1024",
            "--block-size",
            "32",
            "--enable-prefix-caching",
            "--enforce-eager",
            "--num-gpu-blocks-override",
            "48",
            "--kv-transfer-config",
            json.dumps(kvt),
        ]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_CACHE_ROOT": str(self.server.workdir / "vllm-cache"),
        }
        self.proc = start(cmd, self.log, env=env)
        wait_started(
            lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200,
            "vLLM + LMCacheMPConnector",
            proc=self.proc,
            log=self.log,
            stall_s=stall_s,
        )
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None


def main() -> None:  # pragma: no cover - manual smoke: python -m tests.peers.lmcache DIR
    import tempfile

    d = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    s = LMCacheMPServer(d).start()
    try:
        print(s.url, s.status()["is_healthy"])
    finally:
        s.stop()


if __name__ == "__main__":
    main()
