"""Every ``kvtier_*`` metric family the ``kvtier serve`` sidecar registers is documented in
``dashboards/METRICS.md`` (counters under their exposed ``_total`` name), with the label names it has and,
where METRICS.md lists label values, exactly the values the sidecar creates up front.

The sidecar is built with every collector kind configured (engine, LMCache, Mooncake, storage), the
learned placement policy and the LMCache L1 keeper; its peers' URLs point at a closed loopback port;
nothing is polled."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.controller.root import build_sidecar
from kvtier.controller.settings import Settings
from kvtier.controller.sidecar import Sidecar

CONFIGURED = {"layer"}  # label values that depend on what is configured (the actuators): a subset suffices
METRICS_MD = Path(__file__).resolve().parents[2] / "dashboards" / "METRICS.md"


def _sidecar(tmp_path: Path) -> Sidecar:
    down = "http://127.0.0.1:9"
    return build_sidecar(
        Settings.model_validate(
            dict(
                engine_urls=[down],
                engine_model="tiny",
                lmcache_urls=[down],
                mooncake_urls=[down],
                state_dir=str(tmp_path),
                policy="learned",
                actuators=[{"kind": "lmcache-l1", "model_name": "tiny"}],  # the L1 keeper's guard families
            )
        )
    )


def test_every_registered_family_is_documented(tmp_path: Path) -> None:
    sc = _sidecar(tmp_path)
    doc = METRICS_MD.read_text()
    exposed = set()
    for fam in sc.registry.collect():
        if fam.name.startswith("kvtier_"):
            exposed.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    assert len(exposed) >= 40  # every subsystem registered (collectors, storage, loop, shadow, policy)
    missing = sorted(n for n in exposed if not re.search(rf"`{re.escape(n)}`", doc))
    assert not missing, f"served but not in dashboards/METRICS.md: {missing}"


def _parse_labels(text: str) -> dict[str, set[str] | None]:
    """```a` (`x`, `y`), `b``` -> {"a": {"x", "y"}, "b": None}; a parenthesis without backticks is prose."""
    out: dict[str, set[str] | None] = {}
    for m in re.finditer(r"`(\w+)`\s*(\(([^()]*)\))?", text):
        vals = re.findall(r"`([^`]+)`", m.group(3) or "")
        out[m.group(1)] = set(vals) if vals else None
    return out


def documented_labels() -> dict[str, dict[str, set[str] | None]]:
    """Metric -> documented labels (and values), from METRICS.md's tables and its "Also served" list."""
    out = {}
    for ln in METRICS_MD.read_text().splitlines():
        m = re.match(r"^\| `(kvtier_\w+)` \| \w+ \| (.*?) \| ", ln) or re.match(
            r"^- `(kvtier_\w+)` \(\w+; (.+?)\): ", ln
        )
        if m:
            out[m.group(1)] = _parse_labels(m.group(2))
    return out


def registered_labels(
    registry: CollectorRegistry,
) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]]]:
    """(metric -> label names, metric -> label -> values created so far), under the exposed names."""
    names: dict[str, set[str]] = {}
    values: dict[str, dict[str, set[str]]] = {}
    # prometheus_client has no public read of a labelled metric's label names before a series exists
    # (collect() shows series only): its private fields, read here and nowhere in kvtier
    for col in set(registry._names_to_collectors.values()):  # noqa: SLF001 - see above
        kind: Any = getattr(col, "_type", None)
        if kind is not None and hasattr(col, "_labelnames"):
            name = col._name + ("_total" if kind == "counter" else "")  # type: ignore[attr-defined]  # noqa: SLF001
            names[name] = set(col._labelnames)  # noqa: SLF001
    for fam in registry.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        for smp in fam.samples:
            for k, v in smp.labels.items():
                if k not in ("le", "quantile"):
                    names.setdefault(name, set()).add(k)
                    values.setdefault(name, {}).setdefault(k, set()).add(v)
    return names, values


def test_documented_labels_and_values_are_the_registered_ones(tmp_path: Path) -> None:
    """A label METRICS.md promises but nothing emits (a per-action panel that collapses), or an emitted
    value it does not list (a tick outcome), fails here."""
    names, values = registered_labels(_sidecar(tmp_path).registry)
    checked = 0
    for metric, labels in documented_labels().items():
        if metric not in names:
            continue  # registered by the demo's emulated tiers or on first use (names: test above)
        assert set(labels) == names[metric], (metric, sorted(labels), sorted(names[metric]))
        for label, want in labels.items():
            got = values.get(metric, {}).get(label)
            if want is not None and got:
                assert got <= want, (metric, label, "emitted, not documented:", sorted(got - want))
                if label not in CONFIGURED:
                    assert want <= got, (metric, label, "documented, never emitted:", sorted(want - got))
                checked += 1
    assert checked >= 8  # the controller's pre-created outcome/action/tier label sets are compared


def test_status_history_collects_only_its_families_and_misses_none(tmp_path: Path) -> None:
    """The status page samples a few families every second from the registry's restricted view, which only
    reaches collectors that declare their families: on the fully configured sidecar it finds every sample a
    whole collect finds for those names, and it skips the other collectors."""
    from kvtier.controller import status_page

    sc = _sidecar(tmp_path)
    whole: dict[str, list[tuple[dict[str, str], float]]] = {n: [] for n in status_page.HISTORY_SAMPLES}
    for fam in sc.registry.collect():
        for s in fam.samples:
            if s.name in whole:
                whole[s.name].append((dict(s.labels), float(s.value)))
    assert status_page.sampled_families(sc.registry, status_page.HISTORY_SAMPLES) == whole
    assert whole["kvtier_blocks_tracked"] and whole["kvtier_guard_acting"]  # custom exporter and keeper
    served = {f.name for f in sc.registry.restricted_registry(status_page.HISTORY_SAMPLES).collect()}
    assert "kvtier_kv_events" not in served and "process_cpu_seconds" not in served
