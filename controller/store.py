"""SQLite persistence in the state directory: the policy document, pins and trained models."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from kvtier.controller.pins import Pin

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (version INTEGER PRIMARY KEY, info TEXT NOT NULL, blob BLOB);
"""


class StateStore:
    """One SQLite file (``state_dir/kvtier.sqlite3``); safe to share between the loop and API threads."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if p.suffix == "" or p.is_dir():
            p.mkdir(parents=True, exist_ok=True)
            p = p / "kvtier.sqlite3"
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(p), check_same_thread=False)
        with self._lock, self._db:
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- policy / kv ---------------------------------------------------------------------------------------
    def put_json(self, key: str, value: Any) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def get_json(self, key: str) -> Any | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_key(self, key: str) -> bool:
        """Drop ``key``; True when it was there."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount > 0

    # -- pins ----------------------------------------------------------------------------------------------
    def save_pin(self, pin: Pin) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO pins(id, record) VALUES (?, ?)", (pin.id, json.dumps(pin.to_record()))
            )

    def delete_pin(self, pin_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM pins WHERE id = ?", (pin_id,))

    def load_pins(self) -> list[Pin]:
        with self._lock:
            rows = self._db.execute("SELECT record FROM pins").fetchall()
        return [Pin.from_record(json.loads(r[0])) for r in rows]

    # -- models --------------------------------------------------------------------------------------------
    def save_model(self, info: dict[str, Any], blob: bytes | None) -> int:
        with self._lock, self._db:
            cur = self._db.execute("INSERT INTO models(info, blob) VALUES (?, ?)", (json.dumps(info), blob))
            return int(cur.lastrowid or 0)

    def latest_model(self) -> tuple[int, dict[str, Any], bytes | None] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT version, info, blob FROM models ORDER BY version DESC LIMIT 1"
            ).fetchone()
        return None if row is None else (int(row[0]), json.loads(row[1]), row[2])
