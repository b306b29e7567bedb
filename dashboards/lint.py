"""Read kvtier's dashboard JSON back: every PromQL expression (panel targets and variable queries) with the
Grafana variables substituted, the metric names each one needs, and a structural lint.

    python -m kvtier.dashboards.lint    # prints problems, exit 1 if any
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROVISIONED_DATASOURCES = REPO / "deploy" / "grafana" / "provisioning" / "datasources"

# What the end-to-end run substitutes for Grafana's variables (All = ".*").
DEFAULT_VARS: dict[str, str] = {"__rate_interval": "30s", "__interval": "15s", "__range": "5m"}

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_METRIC = re.compile(r"(?<![\w:])(vllm:[A-Za-z0-9_:]+|lmcache_mp_[A-Za-z0-9_]+|kvtier_[A-Za-z0-9_]+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),\s*)?(\w+)\)\s*$", re.S)

# Template variables each board must offer (datasource, engine, model, tier where its queries can use them;
# the controller's engine is kvtier's ``engine`` label, ``$kv_engine``, not vLLM's DP rank).
REQUIRED_VARIABLES: dict[str, set[str]] = {
    "kvtier-overview.json": {"datasource", "model", "engine"},
    "kvtier-tiers.json": {"datasource", "model", "engine", "tier"},
    "kvtier-controller.json": {"datasource", "kv_engine", "tier"},
}

# Which scrape job a metric name comes from (prefix -> source).
SOURCES = {"vllm:": "vllm", "lmcache_mp_": "lmcache", "kvtier_": "kvtier"}


@dataclass(frozen=True)
class Query:
    """One PromQL expression found in a dashboard."""

    dashboard: str
    panel_id: int
    panel: str
    ref: str  # refId, or "var:<name>" for a template variable
    expr: str  # as written in the JSON

    def resolved(self, variables: Mapping[str, str] | None = None) -> str:
        return substitute(self.expr, variables)

    @property
    def is_variable(self) -> bool:
        return self.ref.startswith("var:")

    @property
    def metrics(self) -> set[str]:
        return metric_names(self.expr)

    @property
    def sources(self) -> set[str]:
        return sources_of(self.expr)

    def __str__(self) -> str:
        return f"{self.dashboard} #{self.panel_id} {self.panel!r} [{self.ref}]"


def metric_names(expr: str) -> set[str]:
    """vllm:/lmcache_mp_/kvtier_ metric names referenced (histogram ``_bucket`` suffix kept)."""
    return set(_METRIC.findall(expr))


def sources_of(expr: str) -> set[str]:
    """Scrape jobs an expression needs data from (``up{job="kvtier"}`` counts as kvtier)."""
    out = {src for m in metric_names(expr) for pre, src in SOURCES.items() if m.startswith(pre)}
    out |= set(re.findall(r'job="(\w+)"', expr))
    return out


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Replace ``$var`` / ``${var}`` with ``variables`` (default :data:`DEFAULT_VARS`; others ``.*``)."""
    values = dict(DEFAULT_VARS)
    values.update(variables or {})

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, ".*")

    return _VAR.sub(repl, expr)


def label_values(expr: str) -> tuple[str | None, str] | None:
    """``label_values(selector, label)`` -> (selector or None, label); None if not that form."""
    m = _LABEL_VALUES.match(expr)
    return (m.group(1), m.group(2)) if m else None


def load(paths: Iterable[Path] | None = None) -> dict[str, dict[str, Any]]:
    """Dashboard file name -> parsed JSON (raises ValueError naming the file on invalid JSON)."""
    out = {}
    for p in sorted(paths if paths is not None else HERE.glob("*.json")):
        try:
            out[p.name] = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: invalid JSON: {e}") from e
    return out


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def queries(dashboards: Mapping[str, dict[str, Any]]) -> list[Query]:
    """Every panel target expression and every query variable, in dashboard order."""
    out = []
    for name, d in dashboards.items():
        for v in d.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                qv = v.get("query")
                expr = qv.get("query", "") if isinstance(qv, dict) else str(qv)
                out.append(Query(name, 0, f"${v['name']}", f"var:{v['name']}", expr))
        for p in _panels(d.get("panels", [])):
            for t in p.get("targets", []):
                out.append(
                    Query(
                        name,
                        int(p.get("id", -1)),
                        str(p.get("title", "")),
                        str(t.get("refId")),
                        str(t.get("expr", "")),
                    )
                )
    return out


def provisioned_datasource_uids(folder: Path = PROVISIONED_DATASOURCES) -> set[str]:
    """uids of the datasources in Grafana provisioning files (``uid: X`` lines)."""
    uids = set()
    for f in sorted(folder.glob("*.y*ml")):
        uids |= set(re.findall(r"^\s*uid:\s*['\"]?([\w.-]+)['\"]?\s*$", f.read_text(), re.M))
    return uids


def _ds_refs(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "datasource":
                yield where, v
            yield from _ds_refs(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _ds_refs(v, f"{where}[{i}]")


def lint(dashboards: Mapping[str, dict[str, Any]], datasource_uids: set[str] | None = None) -> list[str]:
    """Problems: missing uid/title/schemaVersion, duplicate uids or panel ids, panels without queries,
    empty expressions, unresolvable datasource references, undefined variables, missing required
    (:data:`REQUIRED_VARIABLES`) or unused query variables. Empty list = clean."""
    uids_ok = {"-- Grafana --"} | (
        datasource_uids if datasource_uids is not None else provisioned_datasource_uids()
    )
    problems: list[str] = []
    seen_uids: dict[str, str] = {}
    for name, d in dashboards.items():
        for key in ("uid", "title", "schemaVersion", "panels"):
            if key not in d:
                problems.append(f"{name}: no {key!r}")
        uid = d.get("uid", "")
        if uid in seen_uids:
            problems.append(f"{name}: uid {uid!r} also used by {seen_uids[uid]}")
        seen_uids[uid] = name
        variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
        ds_vars = {n for n, v in variables.items() if v.get("type") == "datasource"}
        ids: dict[int, str] = {}
        for p in _panels(d.get("panels", [])):
            pid = p.get("id")
            if not isinstance(pid, int):
                problems.append(f"{name}: panel {p.get('title')!r} has no integer id")
            elif pid in ids:
                problems.append(f"{name}: panel id {pid} used by {ids[pid]!r} and {p.get('title')!r}")
            else:
                ids[pid] = str(p.get("title"))
            if p.get("type") != "row" and not p.get("targets"):
                problems.append(f"{name}: panel {pid} {p.get('title')!r} has no targets")
            for t in p.get("targets", []):
                if not str(t.get("expr", "")).strip():
                    problems.append(f"{name}: panel {pid} target {t.get('refId')} has an empty expr")
        for where, ref in _ds_refs(d, name):
            uid_ref = ref.get("uid") if isinstance(ref, dict) else ref
            if not isinstance(uid_ref, str):
                problems.append(f"{where}: datasource reference {ref!r} has no uid")
                continue
            m = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", uid_ref)
            if m:
                var = m.group(1) or m.group(2)
                if var not in ds_vars:
                    problems.append(f"{where}: datasource variable ${var} is not a datasource variable")
            elif uid_ref not in uids_ok:
                problems.append(f"{where}: datasource uid {uid_ref!r} is not provisioned ({sorted(uids_ok)})")
        used: set[str] = set()
        for q in queries({name: d}):
            for m in _VAR.finditer(q.expr):
                var = m.group(1) or m.group(2)
                if not q.is_variable:
                    used.add(var)
                if var not in variables and var not in DEFAULT_VARS:
                    problems.append(f"{q}: uses undefined variable ${var}")
        for var in sorted(REQUIRED_VARIABLES.get(name, set()) - set(variables)):
            problems.append(f"{name}: no template variable ${var}")
        for var, v in variables.items():
            if v.get("type") == "query" and var not in used:
                problems.append(f"{name}: template variable ${var} is used by no panel query")
    return problems


def main() -> int:
    problems = lint(load())
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
