"""Session-wide hooks: the live tests' figures printed after the run, and a check that the suite wrote
nothing into the repository (tests write only under temporary directories)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import figures

REPO = Path(__file__).resolve().parents[1]
# written by Python and the tools themselves, not by a test
_TOOL_CACHES = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis")
_status_key = pytest.StashKey[set[str] | None]()


def _repo_status() -> set[str] | None:
    """``git status`` entries (untracked and ignored ones too) apart from tool caches; None outside git."""
    try:
        r = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return {
        ln for ln in r.stdout.splitlines() if not any(f"{c}/" in ln or ln.endswith(c) for c in _TOOL_CACHES)
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_status_key] = _repo_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_status_key, None)
    after = _repo_status()
    if before is None or after is None or getattr(session.config, "workerinput", None) is not None:
        return
    added = sorted(after - before)
    if added:
        session.config.stash[_added_key] = added
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_added_key = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in figures.lines():
        terminalreporter.write_line(line)
    added = terminalreporter.config.stash.get(_added_key, [])
    if added:
        terminalreporter.write_sep(
            "=", "the test run changed the repository (tests must write under tmp)", red=True
        )
        for ln in added:
            terminalreporter.write_line(ln)
