"""Run mypy over kvtier as users import it (``kvtier.controller`` ...) and over the repo's other Python.

``pyproject.toml`` maps the top-level folders (``collectors/``, ``controller/`` ...) into ``kvtier.*``
with ``package-dir``; mypy cannot read that mapping (the editable install resolves it with an import
hook, which mypy never runs), so it would check three files and treat every ``kvtier.*`` import as
missing. This builds the import-name view mypy needs — a throw-away folder of symlinks in a temporary
directory, never in the repository — runs mypy on it, and prints paths as the repository's own.

Usage: python scripts/typecheck.py [extra mypy args]     (exit status is mypy's)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the other top-level Python folders, checked as they are imported (``tests.peers``, ``bench.x``)
OTHER_ROOTS = ["tests", "bench", "scripts"]


def _package_dirs() -> dict[str, str]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs: dict[str, str] = conf["tool"]["setuptools"]["package-dir"]
    return dirs


def build_view(dest: Path) -> None:
    """Lay out ``dest/kvtier/...`` as symlinks to the mapped folders (the longest names first win)."""
    for name, folder in sorted(_package_dirs().items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*name.split("."))
        if target.exists():
            continue  # a sub-package already reached through its parent's link
        if name == "kvtier":
            target.mkdir(parents=True)
            for item in (ROOT / folder).iterdir():
                if item.name != "__pycache__":
                    (target / item.name).symlink_to(item)
        else:
            target.symlink_to(ROOT / folder, target_is_directory=True)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-typecheck-") as tmp:
        view = Path(tmp)
        build_view(view)
        targets = ["kvtier"]
        for folder in OTHER_ROOTS:
            if (ROOT / folder).is_dir():
                (view / folder).symlink_to(ROOT / folder, target_is_directory=True)
                targets.append(folder)
        # run inside the view so that its ``kvtier`` (the mapped one) is the only one mypy can find
        proc = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets, *argv],
            cwd=view,
            env=dict(os.environ, MYPYPATH=str(view)),
            capture_output=True,
            text=True,
        )
    # the view's paths (``kvtier/controller/loop.py``) back to the repository's (``controller/loop.py``)
    mapping = {"/".join(n.split(".")) + "/": f + "/" for n, f in _package_dirs().items()}
    for stream, out in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        for line in out.splitlines():
            for src in sorted(mapping, key=len, reverse=True):
                if line.startswith(src):
                    line = mapping[src] + line[len(src) :]
                    break
            print(line, file=stream)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
