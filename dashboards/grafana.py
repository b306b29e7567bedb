"""A tiny builder for Grafana dashboard JSON (schema 39, Grafana 10.4+/11): panels laid out on the 24-column
grid in order, ids assigned sequentially so they are unique per dashboard, every query bound to the
``${datasource}`` variable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DS_VAR = "datasource"
DS_REF: dict[str, str] = {"type": "prometheus", "uid": "${" + DS_VAR + "}"}


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel; ``legend`` is Grafana's legendFormat."""

    expr: str
    legend: str = "__auto"
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    """A panel before layout: ``kind`` is a Grafana panel type (timeseries, stat, table, ...)."""

    title: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    stack: bool = False
    thresholds: tuple[tuple[float | None, str], ...] = ((None, "green"),)


def ts(title: str, *targets: Target, **kw: Any) -> Panel:
    return Panel(title, tuple(targets), "timeseries", **kw)


def stat(title: str, *targets: Target, **kw: Any) -> Panel:
    kw.setdefault("width", 6)
    kw.setdefault("height", 4)
    return Panel(title, tuple(targets), "stat", **kw)


def table(title: str, *targets: Target, **kw: Any) -> Panel:
    return Panel(title, tuple(Target(t.expr, t.legend, instant=True) for t in targets), "table", **kw)


def query_var(name: str, label: str, query: str) -> dict[str, Any]:
    """A multi-value Prometheus query variable with All (= ``.*``)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": dict(DS_REF),
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def datasource_var() -> dict[str, Any]:
    return {
        "name": DS_VAR,
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "options": [],
        "regex": "",
        "refresh": 1,
        "includeAll": False,
        "multi": False,
        "hide": 0,
    }


@dataclass
class Dashboard:
    """Collects rows and panels; :meth:`to_json` lays them out and numbers them."""

    uid: str
    title: str
    description: str
    variables: list[dict[str, Any]]
    tags: tuple[str, ...] = ("kvtier",)
    _items: list[tuple[str, Panel | str]] = field(default_factory=list)

    def row(self, title: str) -> Dashboard:
        self._items.append(("row", title))
        return self

    def add(self, *panels: Panel) -> Dashboard:
        for p in panels:
            if p.width > GRID_WIDTH or p.width < 1:
                raise ValueError(f"panel {p.title!r}: width {p.width} not in 1..{GRID_WIDTH}")
            if not p.targets:
                raise ValueError(f"panel {p.title!r} has no query")
            self._items.append(("panel", p))
        return self

    def to_json(self) -> dict[str, Any]:
        panels: list[dict[str, Any]] = []
        next_id = 1
        x = y = row_h = 0
        for kind, item in self._items:
            if kind == "row":
                assert isinstance(item, str)
                if x:
                    y += row_h
                x = row_h = 0
                panels.append(
                    {
                        "id": next_id,
                        "type": "row",
                        "title": item,
                        "collapsed": False,
                        "panels": [],
                        "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                    }
                )
                next_id += 1
                y += 1
                continue
            assert isinstance(item, Panel)
            if x + item.width > GRID_WIDTH:
                y += row_h
                x = row_h = 0
            panels.append(_panel_json(item, next_id, x, y))
            next_id += 1
            x += item.width
            row_h = max(row_h, item.height)
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,
            "timezone": "browser",
            "time": {"from": "now-1h", "to": "now"},
            "refresh": "10s",
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "links": [
                {
                    "title": "kvtier dashboards",
                    "type": "dashboards",
                    "tags": ["kvtier"],
                    "asDropdown": True,
                    "includeVars": True,
                    "keepTime": True,
                    "icon": "external link",
                    "targetBlank": False,
                    "tooltip": "",
                    "url": "",
                }
            ],
            "templating": {"list": self.variables},
            "panels": panels,
        }


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in p.thresholds]},
    }
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    options: dict[str, Any]
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if p.stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    elif p.kind == "table":
        options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}}
    else:
        raise ValueError(f"unsupported panel type {p.kind!r}")
    targets = []
    for i, t in enumerate(p.targets):
        tj: dict[str, Any] = {
            "datasource": dict(DS_REF),
            "editorMode": "code",
            "expr": t.expr,
            "legendFormat": t.legend,
            "range": not t.instant,
            "instant": t.instant,
            "refId": chr(ord("A") + i),
        }
        if t.instant:
            tj["format"] = "table"
        targets.append(tj)
    out: dict[str, Any] = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": dict(DS_REF),
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
    }
    if p.kind == "table":
        out["transformations"] = [{"id": "merge", "options": {}}]
    return out
