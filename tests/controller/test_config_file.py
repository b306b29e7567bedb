"""A config file with a key that is not a setting stops ``kvtier serve`` with one line naming the key.

The failure this guards against: ``engine_url = ...`` (for ``engine_urls``) used to start a sidecar watching
no engine that reported itself ready.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.controller.settings import load_settings

BAD = {
    "bad.toml": 'engine_url = ["http://127.0.0.1:9"]\nscrape_intervall_s = 1\n',
    "bad.yaml": "engine_urls: [http://127.0.0.1:9]\nscrape_intervall_s: 1\n",
    "bad.json": '{"engine_urls": [], "lisen": "127.0.0.1:0"}',
}
NAMED = {
    "bad.toml": ["engine_url", "scrape_intervall_s"],
    "bad.yaml": ["scrape_intervall_s"],
    "bad.json": ["lisen"],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_serve_exits_2_naming_the_misspelled_key(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / name
    cfg.write_text(BAD[name])
    r = subprocess.run(
        [sys.executable, "-c", "from kvtier.cli import main; main()", "serve", "--config", str(cfg),
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier serve: "), r.stderr
    assert "Traceback" not in r.stderr
    for key in NAMED[name]:
        assert f"'{key}'" in lines[0]
    assert not (tmp_path / "state").exists()  # nothing started


def test_a_good_yaml_file_sets_the_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_SCRAPE_INTERVAL_S", raising=False)
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("engine_urls: [http://127.0.0.1:8000]\nscrape_interval_s: 1.5\nmode: shadow\n")
    s = load_settings(cfg)
    assert s.collectors.engine_urls == ["http://127.0.0.1:8000"] and s.collectors.scrape_interval_s == 1.5
    assert s.serve.mode == "shadow"


def test_a_misspelled_keyword_in_code_is_an_error_too() -> None:
    from pydantic import ValidationError

    from kvtier.controller.settings import Settings

    with pytest.raises(ValidationError, match="engine_url"):
        Settings(engine_url=["http://127.0.0.1:8000"])  # type: ignore[call-arg]
