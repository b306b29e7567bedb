"""One composition root and one app factory (issue 16).

The sidecar's parts are built only by :mod:`kvtier.controller.root` and served only by
:func:`kvtier.controller.app.create_app`: a scan of every Python file in the repository's folders finds no
other construction of a FastAPI app, of the sidecar or its parts, nor of a :class:`ReconcileLoop` outside the
root (tests of the loop as a unit excepted, by name). Then ``kvtier serve``'s composition is built and
served in-process: the routes production serves are all there.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from kvtier.controller.app import create_app
from tests.controller import built

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("collectors", "controller", "policies", "replay", "dashboards", "bench", "scripts", "tests",
           "kvtier")  # fmt: skip

APP_FACTORY = "controller/app.py"
ROOT = "controller/root.py"
# class -> the one module allowed to construct it
ONLY_IN = {
    "FastAPI": {APP_FACTORY},
    "FastAPIOffline": {APP_FACTORY},
    "Sidecar": {ROOT},
    "CollectorSet": {ROOT},
    "ControlPlane": {ROOT},
    "ControlSink": {ROOT},
    "ControlContext": {ROOT},
    "ReconcileLoop": {
        ROOT,
        # the loop's own unit tests build it bare (no API, no collectors)
        "tests/controller/test_loop.py",
        "tests/controller/test_tick_fast_paths.py",
    },
}


OWNERS = ("kvtier", "fastapi", "fastapi_offline")  # modules whose classes ONLY_IN names


@functools.cache
def _sources() -> tuple[Path, ...]:
    out: list[Path] = []
    for folder in FOLDERS:
        base = REPO / folder
        if base.is_symlink():  # kvtier/<folder> links to a top-level folder scanned on its own
            continue
        out += [p for p in base.rglob("*.py") if not any(part.startswith(".") for part in p.parts)]
    return tuple(out)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _constructions(path: Path) -> list[tuple[str, int]]:
    """(class name, line) of every call of a class in ``ONLY_IN`` imported from kvtier or FastAPI
    (``Name(...)`` after ``from kvtier... import Name [as N]``, ``module.Name(...)`` after ``import kvtier...
    as module``); a file's own class of that name (a bench's ``Sidecar`` subprocess wrapper) is not one."""
    tree = _tree(path)
    names: dict[str, str] = {}  # local name -> class
    modules: set[str] = set()  # local names of imported owner modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OWNERS:
            names.update({a.asname or a.name: a.name for a in node.names if a.name in ONLY_IN})
        elif isinstance(node, ast.Import):
            roots = [(a.asname or a.name.split(".")[0], a.name.split(".")[0]) for a in node.names]
            modules.update(local for local, root in roots if root in OWNERS)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            found.append((names[f.id], node.lineno))
        elif isinstance(f, ast.Attribute) and f.attr in ONLY_IN:
            base = f.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append((f.attr, node.lineno))
    return found


def test_only_the_root_and_the_app_factory_construct_the_sidecar_and_its_app() -> None:
    sources = _sources()
    assert len(sources) > 100 and (REPO / ROOT) in sources and (REPO / APP_FACTORY) in sources
    bad = []
    seen: dict[str, set[str]] = {}
    for path in sources:
        rel = path.relative_to(REPO).as_posix()
        for name, line in _constructions(path):
            seen.setdefault(name, set()).add(rel)
            if rel not in ONLY_IN[name]:
                bad.append(f"{rel}:{line}: {name}(...) outside {' / '.join(sorted(ONLY_IN[name]))}")
    assert not bad, "\n".join(bad)
    # the scan sees the constructions that do exist (it would pass vacuously on a broken AST walk)
    assert seen["FastAPIOffline"] == {APP_FACTORY} and ROOT in seen["ReconcileLoop"]
    assert seen["Sidecar"] == {ROOT}


def test_exactly_one_composition_root_and_app_factory() -> None:
    defs: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and node.name in ("build_sidecar", "create_app"):
                defs.setdefault(node.name, []).append(path.relative_to(REPO).as_posix())
    assert defs == {"build_sidecar": [ROOT], "create_app": [APP_FACTORY]}
    gone = [m for m in ("runtime.py", "control_sidecar.py") if (REPO / "controller" / m).exists()]
    assert not gone, f"the old wiring modules are back: {gone}"


def test_the_production_composition_serves_every_route(tmp_path: Path) -> None:
    sc = built.sidecar(tmp_path, api_token="t")
    paths = set(create_app(sc, manage_lifecycle=False).openapi()["paths"])
    for p in ("/metrics", "/v1/status", "/healthz", "/readyz", "/v1/policy", "/v1/pins", "/v1/decisions"):
        assert p in paths, p
    c = built.client(sc)
    st = c.get("/v1/status").json()
    # collectors' view and the controller's in one document
    assert st["mode"] == "shadow" and "blocks_tracked" in st and st["policy_source"]["policy"] == "default"
    assert c.patch("/v1/policy", json={"mode": "off"}).status_code == 401  # the request guard is mounted
    sc.plane.store.close()
