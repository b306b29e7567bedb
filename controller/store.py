"""SQLite persistence in the state directory: the policy document, pins and trained models.

Survives mistakes rather than crash-looping the sidecar:

* WAL journal and a busy timeout (the loop, the retrain thread and API threads share one file).
* ``PRAGMA user_version`` migrations (:data:`SCHEMA_VERSION`); a newer version than this build knows is
  treated like a corrupt file.
* A file that is not a database, fails ``quick_check`` or cannot be migrated is moved aside
  (``kvtier.sqlite3.corrupt-<unix time>``) and a fresh one is created; an unwritable state directory falls
  back to an in-memory database. Either way the sidecar starts on defaults and the reason is counted in
  :attr:`StateStore.errors` (exported as ``kvtier_state_errors_total{kind}``) and logged as an error.
* Rows are read one by one: a bad pin or model row is skipped and counted (``kind="row"``), never fatal.
* Callers write the database first and change memory only when the write succeeded (:class:`StoreError`).
* Models are stored as JSON (plain numbers, never executable serialisation); only the newest
  :attr:`keep_models` rows are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvtier.controller.pins import Pin

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_MIGRATIONS: dict[int, str] = {
    # 0 -> 1: the original schema
    1: """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (version INTEGER PRIMARY KEY, info TEXT NOT NULL, blob BLOB);
""",
    # 1 -> 2: model parameters as JSON text (older binary blobs are ignored, never deserialised)
    2: "ALTER TABLE models ADD COLUMN params TEXT;",
}


class StoreError(RuntimeError):
    """A write to the state database failed (read-only file, full disk, locked too long)."""


class StateStore:
    """One SQLite file (``state_dir/kvtier.sqlite3``); safe to share between the loop and API threads."""

    keep_models = 5

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 5.0) -> None:
        self.errors: Counter[str] = Counter()  # kind -> count (open, corrupt, migrate, row, write)
        self._lock = threading.Lock()
        self.busy_timeout_s = busy_timeout_s
        p = Path(path)
        try:
            if p.suffix == "" or p.is_dir():
                p.mkdir(parents=True, exist_ok=True)
                p = p / "kvtier.sqlite3"
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._error("open", f"state directory {p} unusable ({exc}); state is kept in memory only")
            p = Path(":memory:")
        self.path = p
        self._db = self._open()

    # -- opening -------------------------------------------------------------------------------------------
    def _error(self, kind: str, msg: str) -> None:
        self.errors[kind] += 1
        log.error("state store: %s", msg)

    def _connect(self, target: str) -> sqlite3.Connection:
        db = sqlite3.connect(target, check_same_thread=False, timeout=self.busy_timeout_s)
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        if target != ":memory:":
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            row = db.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                db.close()
                raise sqlite3.DatabaseError(f"quick_check: {row[0] if row else 'no answer'}")
        self._migrate(db)
        return db

    def _open(self) -> sqlite3.Connection:
        target = str(self.path)
        try:
            return self._connect(target)
        except sqlite3.DatabaseError as exc:  # not a database / malformed / newer schema / read-only
            if target == ":memory:":
                raise
            if isinstance(exc, sqlite3.OperationalError) and "readonly" in str(exc).lower():
                self._error("open", f"{target} is read-only ({exc}); state is kept in memory only")
                self.path = Path(":memory:")
                return self._connect(":memory:")
            aside = f"{target}.corrupt-{int(time.time())}"
            try:
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(target + suffix):
                        os.replace(target + suffix, aside + suffix)
                self._error(
                    "corrupt", f"{target} is unusable ({exc}); moved to {aside}, starting on defaults"
                )
                return self._connect(target)
            except (OSError, sqlite3.DatabaseError) as exc2:
                self._error("open", f"{target} unusable and cannot be replaced ({exc2}); in memory only")
                self.path = Path(":memory:")
                return self._connect(":memory:")

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"schema version {version} is newer than this build's {SCHEMA_VERSION}"
            )
        if version == 0:  # pre-versioning files already have the version-1 tables
            cols = db.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name='models'"
            ).fetchall()
            if cols:
                have = {r[1] for r in db.execute("PRAGMA table_info(models)").fetchall()}
                version = 2 if "params" in have else 1
        with db:
            for v in range(version + 1, SCHEMA_VERSION + 1):
                db.executescript(_MIGRATIONS[v])
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            with self._lock, self._db:
                return self._db.execute(sql, args)
        except sqlite3.Error as exc:
            self._error("write", f"write failed: {exc}")
            raise StoreError(f"state database write failed: {exc}") from exc

    # -- policy / kv ---------------------------------------------------------------------------------------
    def put_json(self, key: str, value: Any) -> None:
        self._write("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_json(self, key: str) -> Any | None:
        try:
            with self._lock:
                row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            return None if row is None else json.loads(row[0])
        except (sqlite3.Error, ValueError, TypeError) as exc:
            self._error("row", f"kv {key!r} unreadable, ignored: {exc}")
            return None

    def delete_key(self, key: str) -> bool:
        """Drop ``key``; True when it was there."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount > 0

    # -- pins ----------------------------------------------------------------------------------------------
    def save_pin(self, pin: Pin) -> None:
        self._write(
            "INSERT OR REPLACE INTO pins(id, record) VALUES (?, ?)", (pin.id, json.dumps(pin.to_record()))
        )

    def delete_pin(self, pin_id: str) -> None:
        self._write("DELETE FROM pins WHERE id = ?", (pin_id,))

    def load_pins(self) -> list[Pin]:
        """Every readable pin; a row that does not parse is skipped and counted (``errors["row"]``)."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT id, record FROM pins").fetchall()
        except sqlite3.Error as exc:
            self._error("row", f"pins unreadable, starting without pins: {exc}")
            return []
        out = []
        for pid, rec in rows:
            try:
                out.append(Pin.from_record(json.loads(rec)))
            except (ValueError, TypeError, KeyError) as exc:
                self._error("row", f"pin {str(pid)[:40]!r} unreadable, skipped: {exc}")
        return out

    # -- models --------------------------------------------------------------------------------------------
    def save_model(self, info: dict[str, Any], params: dict[str, Any]) -> int:
        """Persist a model (``params``: JSON-able plain numbers/lists); prune all but the newest few."""
        cur = self._write(
            "INSERT INTO models(info, blob, params) VALUES (?, NULL, ?)",
            (json.dumps(info), json.dumps(params)),
        )
        version = int(cur.lastrowid or 0)
        with contextlib.suppress(StoreError):  # pruning is housekeeping; the model itself is saved
            self._write(
                "DELETE FROM models WHERE version NOT IN "
                "(SELECT version FROM models ORDER BY version DESC LIMIT ?)",
                (self.keep_models,),
            )
        return version

    def model_count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM models").fetchone()[0])

    def latest_model(self) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """(version, info, params) of the newest readable JSON model; legacy binary rows are skipped."""
        try:
            with self._lock:
                rows = self._db.execute(
                    "SELECT version, info, params FROM models ORDER BY version DESC LIMIT ?",
                    (self.keep_models,),
                ).fetchall()
        except sqlite3.Error as exc:
            self._error("row", f"models unreadable, starting without a model: {exc}")
            return None
        for version, info, params in rows:
            if params is None:
                continue  # a legacy binary row: never deserialised
            try:
                i, p = json.loads(info), json.loads(params)
                if isinstance(i, dict) and isinstance(p, dict):
                    return int(version), i, p
            except (ValueError, TypeError) as exc:
                self._error("row", f"model {version} unreadable, skipped: {exc}")
        return None


class StateStoreExporter:
    """``kvtier_state_errors_total{kind}``: state-store troubles (open, corrupt, row, write) since start."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = CounterMetricFamily(
            "kvtier_state_errors",
            "State-store errors (open, corrupt, row, write) since start.",
            labels=["kind"],
        )
        for kind in ("open", "corrupt", "row", "write"):
            c.add_metric([kind], float(self.store.errors.get(kind, 0)))
        yield c
        g = GaugeMetricFamily("kvtier_state_in_memory", "1 when the state store fell back to memory only.")
        g.add_metric([], 1.0 if str(self.store.path) == ":memory:" else 0.0)
        yield g
