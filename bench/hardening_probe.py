"""Re-run the hostile HTTP/state probes of issue 18 against a real ``kvtier serve`` on 127.0.0.1.

Each probe starts a fresh sidecar subprocess (``--python``/``--pythonpath`` select the build, so the same
driver measures the tree before and after a change) with ``KVTIER_API_TOKEN`` set unless the probe is about
running without one. Bounded: every probe has a time limit and a fixed request count.

Run: ``python -m bench.hardening_probe`` (``--only NAME`` for one probe).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

TOKEN = "probe-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sidecar:
    def __init__(self, args: argparse.Namespace, *, token: bool = True, state: str | None = None,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.port = free_port()
        self.state = state or tempfile.mkdtemp(prefix="kvtier-probe-")
        e = dict(os.environ, KVTIER_STORAGE_ENABLED="false", **(env or {}))
        e.pop("KVTIER_API_TOKEN", None)
        if token:
            e["KVTIER_API_TOKEN"] = TOKEN
        if args.pythonpath:
            e["PYTHONPATH"] = args.pythonpath
        self.log = Path(self.state) / "serve.log"
        self.proc = subprocess.Popen(
            [args.python, "-m", "kvtier", "serve", "--listen", f"127.0.0.1:{self.port}", "--state-dir",
             self.state, "--policy", "none", *extra],
            env=e, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def healthz_during(sc: Sidecar, fn: Callable[[], str]) -> str:
    """Run ``fn`` while polling /healthz every 50 ms; append the slowest /healthz answer."""
    worst = 0.0
    stop = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    c.get(sc.url + "/healthz")
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join(timeout=130)
    return f"{out}; slowest /healthz {worst * 1e3:.0f} ms"


def raw_request(port: int, head: bytes, body_len: int, chunk: int = 1 << 20) -> tuple[str, float]:
    """Send ``head`` then up to ``body_len`` bytes of body while reading; (status line, seconds to it)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head)
        s.setblocking(False)
        sent, buf = 0, b""
        filler = b"1," * (chunk // 2)
        while time.monotonic() - t0 < 120:
            try:
                data = s.recv(65536)
                if not data:
                    break
                buf += data
                if b"\r\n" in buf:
                    break
            except BlockingIOError:
                pass
            if sent < body_len:
                try:
                    sent += s.send(filler[: min(len(filler), body_len - sent)])
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    time.sleep(0.001)
            else:
                time.sleep(0.001)
        return buf.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - t0


def p_no_token_wildcard(args: argparse.Namespace) -> str:
    e = dict(os.environ, KVTIER_STORAGE_ENABLED="false", PYTHONPATH=args.pythonpath or "")
    e.pop("KVTIER_API_TOKEN", None)
    p = subprocess.Popen([args.python, "-m", "kvtier", "serve", "--listen", f"0.0.0.0:{free_port()}",
                          "--state-dir", tempfile.mkdtemp()], env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)  # fmt: skip
    try:
        p.wait(timeout=20)
        return f"--listen 0.0.0.0 without a token: exit {p.returncode} (refused)"
    except subprocess.TimeoutExpired:
        p.terminate()
        p.wait()
        return "--listen 0.0.0.0 without a token: started and served (mutations open)"


def p_whitespace_token(args: argparse.Namespace) -> str:
    e = dict(
        os.environ, KVTIER_API_TOKEN="   ", KVTIER_STORAGE_ENABLED="false", PYTHONPATH=args.pythonpath or ""
    )
    p = subprocess.Popen([args.python, "-m", "kvtier", "serve", "--listen", f"127.0.0.1:{free_port()}",
                          "--state-dir", tempfile.mkdtemp()], env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)  # fmt: skip
    try:
        p.wait(timeout=20)
        return f"whitespace token: exit {p.returncode} at start-up"
    except subprocess.TimeoutExpired:
        p.terminate()
        p.wait()
        return "whitespace token: started (every mutation 403 forever)"


def p_host_origin(args: argparse.Namespace) -> str:
    sc = Sidecar(args, token=False)
    try:
        assert sc.wait_up()
        h = httpx.get(sc.url + "/v1/policy", headers={"Host": "attacker.example"}).status_code
        evil = {"Origin": "http://attacker.example", "Content-Type": "text/plain"}
        r = httpx.post(sc.url + "/v1/model/retrain", headers=evil).status_code
        return f"Host: attacker.example -> {h}; cross-origin simple POST /v1/model/retrain -> {r}"
    finally:
        sc.stop()


def p_big_body(args: argparse.Namespace) -> str:
    sc = Sidecar(args)
    try:
        assert sc.wait_up()
        rss0 = sc.rss_mb()
        n = 80 << 20
        head = (f"POST /v1/pins HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {n}\r\n\r\n").encode()  # fmt: skip
        out = healthz_during(sc, lambda: "80 MB POST /v1/pins, no auth: {} after {:.3f} s".format(
            *raw_request(sc.port, head, n)))  # fmt: skip
        return f"{out}; RSS {rss0:.0f} -> {sc.rss_mb():.0f} MB"
    finally:
        sc.stop()


def p_hostile_json(args: argparse.Namespace) -> str:
    sc = Sidecar(args)
    try:
        assert sc.wait_up()
        h = {**AUTH, "Content-Type": "application/json"}
        out = []
        for name, body in (("NaN token_ids", b'{"token_ids": [1, NaN]}'),
                           ("NaN ttl_s", b'{"block_hash": "00000000000000ff", "ttl_s": NaN}'),
                           ("lone surrogate", b'{"prompt": "a\\ud800b"}'),
                           ("retrain_interval_s=1e-6", None), ("tick_timeout_s=1e-300", None)):  # fmt: skip
            if body is None:
                k, v = name.split("=")
                r = httpx.patch(sc.url + "/v1/policy", headers=h,
                                content=json.dumps({"predictor": {k: float(v)}} if k.startswith("retrain")
                                                   else {k: float(v)}).encode())  # fmt: skip
            else:
                r = httpx.post(sc.url + "/v1/pins", content=body, headers=h)
            out.append(f"{name} -> {r.status_code}")
        return "; ".join(out)
    finally:
        sc.stop()


def p_concurrent_patches(args: argparse.Namespace) -> str:
    sc = Sidecar(args)
    try:
        assert sc.wait_up()
        fields = ["hysteresis_s", "pin_retry_s", "min_gain_s", "reuse_threshold", "prefill_s_per_token",
                  "shadow_horizon_s", "tick_interval_s", "tick_timeout_s"]  # fmt: skip
        acked: dict[str, float] = {}

        def worker(f: str) -> int:
            ok = 0
            with httpx.Client(timeout=60) as c:
                for i in range(20):
                    v = round(0.01 * (i + 1) + (0.5 if f.startswith("tick") else 0), 4)
                    if c.patch(sc.url + "/v1/policy", json={f: v}, headers=AUTH).status_code == 200:
                        acked[f] = v
                        ok += 1
            return ok

        with ThreadPoolExecutor(8) as ex:
            n_ok = sum(ex.map(worker, fields))
        got = httpx.get(sc.url + "/v1/policy").json()
        lost_fields = [f for f in fields if got.get(f) != acked.get(f)]
        # a lost field lost all its acknowledged updates after the last one another thread overwrote
        lost = len(lost_fields)
        return f"8 x 20 PATCHes: {n_ok} acknowledged; {lost} of 8 fields not at their last acknowledged value"
    finally:
        sc.stop()


def p_corrupt_state(args: argparse.Namespace) -> str:
    out = []
    for damage in ("garbage", "pin row missing fields"):
        d = tempfile.mkdtemp(prefix="kvtier-probe-")
        db = Path(d) / "kvtier.sqlite3"
        if damage == "garbage":
            db.write_bytes(b"garbage" * 1000)
        else:
            con = sqlite3.connect(db)
            con.executescript("CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                              "CREATE TABLE pins (id TEXT PRIMARY KEY, record TEXT NOT NULL);"
                              "CREATE TABLE models (version INTEGER PRIMARY KEY, info TEXT NOT NULL, "
                              "blob BLOB);"
                              "INSERT INTO pins VALUES ('x', '{\"id\": \"x\"}');")  # fmt: skip
            con.commit()
            con.close()
        sc = Sidecar(args, state=d)
        up = sc.wait_up(30)
        tb = "Traceback" in sc.log.read_text(errors="replace")
        metric = ""
        if up:
            m = [ln for ln in httpx.get(sc.url + "/metrics").text.splitlines()
                 if ln.startswith("kvtier_state_errors_total") and not ln.endswith(" 0.0")]  # fmt: skip
            metric = f", {'; '.join(m) or 'no error metric'}"
        sc.stop()
        out.append(f"{damage}: {'started' if up else f'exit {sc.proc.returncode}'}"
                   f"{', traceback' if tb else ''}{metric}")  # fmt: skip
    return " | ".join(out)


def p_pins(args: argparse.Namespace) -> str:
    sc = Sidecar(args)
    try:
        assert sc.wait_up()
        codes: dict[int, int] = {}
        with httpx.Client(timeout=30) as c:
            for i in range(2000):
                r = c.post(sc.url + "/v1/pins", json={"block_hash": f"{i + 1:016x}"}, headers=AUTH)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            big = c.post(sc.url + "/v1/pins", json={"token_ids": list(range(1_000_000))}, headers=AUTH)
        return f"2,000 pin POSTs: {dict(sorted(codes.items()))}; 1 M-token pin -> {big.status_code}"
    finally:
        sc.stop()


def p_scrape_flood(args: argparse.Namespace) -> str:
    sc = Sidecar(args)
    try:
        assert sc.wait_up()
        lat: list[float] = []
        stop = threading.Event()

        def flood(path: str) -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        c.get(sc.url + path)

        ts = [threading.Thread(target=flood, args=(p,), daemon=True) for p in ["/metrics", "/v1/status"] * 16]
        for t in ts:
            t.start()
        t_end = time.monotonic() + 20
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    c.get(sc.url + "/healthz")
                lat.append(time.monotonic() - t0)
                time.sleep(0.1)
        stop.set()
        for t in ts:
            t.join(timeout=60)
        lat.sort()
        p99 = lat[int(0.99 * len(lat))] * 1e3
        return f"32 clients on /metrics + /v1/status for 20 s: /healthz p99 {p99:.0f} ms"
    finally:
        sc.stop()


def p_slowloris(args: argparse.Namespace) -> str:
    sc = Sidecar(args, env={"KVTIER_HTTP_REQUEST_DEADLINE_S": "5"})
    try:
        assert sc.wait_up()
        socks = []
        for _ in range(2000):
            s = socket.create_connection(("127.0.0.1", sc.port), timeout=10)
            s.sendall(b"GET /v1/policy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(s)
        time.sleep(20)  # fixed observation window of the probe
        open_ = 0
        for s in socks:
            s.setblocking(False)
            try:
                if s.recv(1 << 16) != b"":
                    open_ += 1
            except BlockingIOError:
                open_ += 1
            except OSError:
                pass
            s.close()
        return f"2,000 half-sent requests: {open_} still open after 20 s"
    finally:
        sc.stop()


PROBES: dict[str, Callable[[argparse.Namespace], str]] = {
    "no_token_wildcard": p_no_token_wildcard, "whitespace_token": p_whitespace_token,
    "host_origin": p_host_origin, "big_body": p_big_body, "hostile_json": p_hostile_json,
    "concurrent_patches": p_concurrent_patches, "corrupt_state": p_corrupt_state, "pins": p_pins,
    "scrape_flood": p_scrape_flood, "slowloris": p_slowloris,
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--only", action="append", choices=sorted(PROBES))
    args = ap.parse_args()
    for name in args.only or PROBES:
        t0 = time.monotonic()
        try:
            line = PROBES[name](args)
        except Exception as exc:  # noqa: BLE001 - a probe that breaks the build under test is a result too
            line = f"probe failed: {type(exc).__name__}: {exc}"
        print(f"{name:<20} {line}  [{time.monotonic() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
