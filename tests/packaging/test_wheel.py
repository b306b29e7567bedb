"""The wheel ships every tracked module and data file of the mapped folders, and nothing else.

kvtier's code lives in top-level folders (``collectors/``, ``controller/``, ...) that
``pyproject.toml`` maps into ``kvtier.*``. A mapping that forgets a folder, or package data that
misses a pattern, builds a wheel that imports fine here (the editable install reads the tree) and
breaks on a user's machine, so the wheel is built from a clone without symlinks and compared with
``git ls-files``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# wheel path prefix -> tracked folder
MAPPED = {
    "kvtier/collectors/": "collectors/",
    "kvtier/controller/": "controller/",
    "kvtier/policies/": "policies/",
    "kvtier/replay/": "replay/",
    "kvtier/dashboards/": "dashboards/",
    "kvtier/": "kvtier/",
}


def _tracked() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", *sorted(set(MAPPED.values()))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    wheel_names: set[str] = set()
    for path in out:
        for prefix, folder in MAPPED.items():
            if path.startswith(folder):
                wheel_names.add(prefix + path[len(folder) :])
                break
    return wheel_names


@pytest.mark.slow
def test_wheel_from_a_symlink_free_clone_has_every_tracked_file(tmp_path: Path) -> None:
    # A copy of the tracked tree as a clone with core.symlinks=false would check it out: a tracked
    # symlink becomes a plain file holding its target path. Copying (not cloning) keeps the working
    # tree's uncommitted edits under test too.
    clone = tmp_path / "clone"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    links = []
    for name in filter(None, tracked.decode().split("\0")):
        src, dst = ROOT / name, clone / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            links.append(name)
            dst.write_text(str(src.readlink()))
        else:
            shutil.copy2(src, dst)
    assert links == [], "the tree must hold no symlinks"
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(clone)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if not n.startswith("kvtier-") and "/__pycache__/" not in n}
    expected = {n for n in _tracked() if "/__pycache__/" not in n}
    assert sorted(expected - shipped) == [], "tracked files missing from the wheel"
    assert sorted(shipped - expected) == [], "wheel files that are not tracked sources"
