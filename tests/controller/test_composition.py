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
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from kvtier.controller.app import create_app
from tests.controller import built
from tests.peers.http_server import serving

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


class _Models(BaseHTTPRequestHandler):
    """vLLM's ``GET /v1/models``; counts every request it answers."""

    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        type(self).hits.append(self.path)
        body = json.dumps({"data": [{"id": "tiny", "root": "/models/tiny-root"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


def test_building_does_no_http_and_discover_models_is_the_explicit_step(tmp_path: Path) -> None:
    """``build_sidecar`` sends nothing to the engine (its constructors do no I/O); ``discover_models`` asks
    ``/v1/models`` once and fills the served name and the LMCache entries' ``--model`` path where unset."""
    from kvtier.controller.root import discover_models
    from kvtier.controller.settings import LMCacheL1Settings, LMCacheMPSettings

    _Models.hits = []
    with serving(_Models) as url:
        kw: dict[str, Any] = dict(engine_urls=[url], lmcache_urls=["http://127.0.0.1:9"],
                                  actuators=[{"kind": "lmcache-mp"}, {"kind": "lmcache-l1"}])  # fmt: skip
        sc = built.sidecar(tmp_path / "a", **kw)
        assert _Models.hits == [] and sc.plane.ctx.engine_model == ""
        sc.plane.store.close()
        s = discover_models(built.settings(tmp_path / "b", **kw))
        assert _Models.hits == ["/v1/models"]
        assert s.collectors.engine_model == "tiny"
        mp, l1 = s.actuators
        assert isinstance(mp, LMCacheMPSettings) and mp.model_name == "/models/tiny-root"
        assert isinstance(l1, LMCacheL1Settings) and l1.model_name == "/models/tiny-root"
        sc = built.sidecar(tmp_path / "c", **{**kw, "engine_model": "tiny", "actuators": s.actuators})
        assert sc.plane.ctx.engine_model == "tiny" and sc.l1_keeper is not None
        assert len(_Models.hits) == 1  # building still asked nothing
        sc.plane.store.close()
        given = built.settings(tmp_path / "d", engine_urls=[url], engine_model="served")
        assert discover_models(given) is given and len(_Models.hits) == 1  # nothing to discover: no request
    down = discover_models(built.settings(tmp_path / "e", engine_urls=["http://127.0.0.1:9"]))
    assert down.collectors.engine_model == ""  # unreachable: logged, the sidecar still starts


def test_the_loop_plans_only_when_an_actuator_can_execute_a_plan(tmp_path: Path) -> None:
    """The lmcache-l1 keeper alone decides L1 admission: the loop then observes only (its tier moves would
    have no executor and cost CPU beside the engine); with a planner actuator, or with no keeper at all
    (shadow what-if), it plans."""
    down = ["http://127.0.0.1:9"]
    lm: dict[str, Any] = {"engine_urls": down, "lmcache_urls": down, "engine_model": "tiny"}
    l1, mp = {"kind": "lmcache-l1"}, {"kind": "lmcache-mp"}
    cases = {"keeper": ([l1], False), "both": ([mp, l1], True), "none": ([], True)}
    for name, (acts, plans) in cases.items():
        sc = built.sidecar(tmp_path / name, actuators=acts, **lm)
        try:
            assert sc.plane.loop.plans is plans, name
            assert (sc.l1_keeper is not None) is any(a["kind"] == "lmcache-l1" for a in acts)
        finally:
            sc.plane.store.close()
