"""Run ``lint-imports`` (import-linter; contracts in ``pyproject.toml``) over kvtier as users import it.

Like mypy, import-linter finds ``kvtier`` on disk and walks its folder, so it cannot follow the
``package-dir`` mapping of ``collectors/``, ``controller/`` ... into ``kvtier.*``; this runs it on the
throw-away view of :mod:`scripts.typecheck` (symlinks in a temporary directory, never in the repository).

Usage: python scripts/lint_imports.py [extra lint-imports args]     (exit status is lint-imports')
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from typecheck import ROOT, build_view  # noqa: E402


def main(argv: list[str]) -> int:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    with tempfile.TemporaryDirectory(prefix="kvtier-lint-imports-") as tmp:
        view = Path(tmp)
        build_view(view)
        env = dict(os.environ, PYTHONPATH=str(view))
        cmd = [exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache", *argv]
        return subprocess.run(cmd, cwd=view, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
