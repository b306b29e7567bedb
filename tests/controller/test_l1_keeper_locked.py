"""The L1 keeper against keys LMCache refuses to delete because they are locked: the batch goes again later,
a key seen again meanwhile is left in L1, a lock that outlasts the verify deadline ends ``skipped``.

The layer here is a real HTTP server answering ``DELETE /cache/objects`` as LMCache MP's object service does
(``deleted`` and ``skipped`` = locked counts, no key list; a missing key is a no-op). A real LMCache MP
server holds a chunk's lock only while its L2 write or a look-up's read is under way, a few milliseconds
that a test cannot hold open on purpose; the keeper's subject is what it does with the reply.
"""

from __future__ import annotations

import http.server
import json
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.controller.actuators.lmcache_keys import object_keys
from kvtier.controller.actuators.lmcache_mp import FsL2Verifier, LMCacheMPActuator
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.controller.l1_keeper import L1Keeper
from tests.peers.http_server import serving


class FakeL1:
    """L1 as the object service sees it: the chunk hashes it holds, the ones locked, every DELETE body."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.locked: set[str] = set()
        self.deletes: list[list[str]] = []


def l1_handler(l1: FakeL1) -> type[http.server.BaseHTTPRequestHandler]:
    class H(http.server.BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_DELETE(self) -> None:  # noqa: N802 - http.server API
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            keys = [k["chunk_hash_hex"] for k in req["keys"]]
            l1.deletes.append(keys)
            locked = [h for h in keys if h in l1.held and h in l1.locked]
            gone = [h for h in keys if h in l1.held and h not in l1.locked]
            l1.held.difference_update(gone)
            self._reply(200, {"deleted": len(gone), "skipped": len(locked), "ok": True})

        def do_POST(self) -> None:  # noqa: N802 - a readmission (prefetch): refused, the test counts it
            self._reply(404, {"detail": "not served here"})

        def do_GET(self) -> None:  # noqa: N802 - /metrics, /status: nothing to report
            self._reply(404, {"detail": "not served here"})

        def log_message(self, *a: object) -> None:
            pass

    return H


def _keeper(
    url: str, l2: Path, toks: tuple[int, ...], now: list[float], reg: CollectorRegistry | None = None
) -> L1Keeper:
    act = LMCacheMPActuator(HttpCaller(url, timeout_s=5.0), chunk_size=64, model_name="tiny",
                            l2_verifier=FsL2Verifier(l2), discover_verifier=False)  # fmt: skip
    keeper = L1Keeper(act, chain_tokens=lambda _h: toks, is_active=lambda: True,
                      registry=reg or CollectorRegistry(), probation_chunks=0, delay_s=0.5,
                      verify_deadline_s=3.0, clock=lambda: now[0], measure_every_s=1e9,
                      status_every_s=1e9)  # fmt: skip
    keeper.core.require_calibration = False
    keeper.core.acting = True  # the guard is not this test's subject
    return keeper


def _setup(tmp_path: Path, l1: FakeL1) -> tuple[tuple[int, ...], list[str]]:
    toks = tuple(range(256))  # 4 chunks
    keys = object_keys("tiny", toks, 64)
    for k in keys:  # L2 holds every chunk: the drops are allowed
        (tmp_path / k.fs_filename()).write_bytes(b"kv")
    hashes = [k.chunk_hash_hex for k in keys]
    l1.held.update(hashes)
    return toks, hashes


def test_locked_chunks_are_sent_again_and_dropped_once_unlocked(tmp_path: Path) -> None:
    l1 = FakeL1()
    toks, hashes = _setup(tmp_path, l1)
    l1.locked.update(hashes[:2])  # their L2 write is still under way
    now = [0.0]
    with serving(l1_handler(l1)) as url:
        reg = CollectorRegistry()
        keeper = _keeper(url, tmp_path, toks, now, reg)
        keeper.on_block_stored(None, 1, 16, 16)  # a new prompt: 4 first-sight chunks
        now[0] = 0.5
        keeper.run_due()
        assert keeper.counts["applied"] == 2 and keeper.counts["locked"] == 2
        assert keeper.counts["skipped"] == 0 and keeper.status()["pending"] == 1  # one retry batch
        assert l1.held == set(hashes[:2])
        assert "kvtier_l1_keeper_locked_refusals_total 2.0" in generate_latest(reg).decode()
        keeper.run_due()  # not due yet: nothing is sent
        assert len(l1.deletes) == 1
        l1.locked.clear()
        now[0] = 1.0
        keeper.run_due()
        assert l1.held == set() and len(l1.deletes) == 2
        assert keeper.counts["applied"] == 4 and keeper.counts["skipped"] == 0
        assert keeper.status()["pending"] == 0


def test_a_locked_chunk_seen_again_before_the_retry_stays_in_l1(tmp_path: Path) -> None:
    l1 = FakeL1()
    toks, hashes = _setup(tmp_path, l1)
    l1.locked.add(hashes[0])  # a look-up is reading it: it is being reused
    now = [0.0]
    with serving(l1_handler(l1)) as url:
        keeper = _keeper(url, tmp_path, toks, now)
        keeper.on_block_stored(None, 1, 16, 16)
        now[0] = 0.5
        keeper.run_due()
        assert keeper.counts["applied"] == 3 and keeper.counts["locked"] == 1
        keeper.on_block_stored(None, 1, 16, 16)  # the same prompt again: its second sight
        l1.locked.clear()
        now[0] = 1.0
        keeper.run_due()  # the retry leaves out what was seen again; the readmission is refused here
        assert hashes[0] in l1.held
        assert all(hashes[0] not in d for d in l1.deletes[1:])
        assert keeper.counts["applied"] == 3 and keeper.counts["skipped"] == 1
        assert keeper.counts["readmit_failed"] == 1


def test_a_lock_outlasting_the_deadline_ends_skipped_and_the_chunk_stays(tmp_path: Path) -> None:
    l1 = FakeL1()
    toks, hashes = _setup(tmp_path, l1)
    l1.locked.add(hashes[3])
    now = [0.0]
    with serving(l1_handler(l1)) as url:
        keeper = _keeper(url, tmp_path, toks, now)
        keeper.on_block_stored(None, 1, 16, 16)
        for step in range(1, 12):  # 0.5 s steps past the 3 s deadline
            now[0] = 0.5 * step
            keeper.run_due()
        assert keeper.status()["pending"] == 0
        assert keeper.counts["applied"] == 3 and keeper.counts["skipped"] == 1
        assert keeper.counts["locked"] >= 5  # refused at each try until the deadline
        assert l1.held == {hashes[3]}
