"""Every ``kvtier_*`` metric family the ``kvtier serve`` sidecar registers is documented in
``dashboards/METRICS.md`` (counters under their exposed ``_total`` name).

The sidecar is built with every collector kind configured (engine, LMCache, Mooncake, storage) and the
learned placement policy; its peers' URLs point at a closed loopback port; nothing is polled."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.controller.control_sidecar import ControlledSidecar
from kvtier.controller.settings import Settings

METRICS_MD = Path(__file__).resolve().parents[2] / "dashboards" / "METRICS.md"


def test_every_registered_family_is_documented(tmp_path: Path) -> None:
    down = "http://127.0.0.1:9"
    sc = ControlledSidecar(
        Settings(
            engine_urls=[down],
            engine_model="tiny",
            lmcache_urls=[down],
            mooncake_urls=[down],
            state_dir=str(tmp_path),
            policy="learned",
        )  # fmt: skip
    )
    doc = METRICS_MD.read_text()
    exposed = set()
    for fam in sc.registry.collect():
        if fam.name.startswith("kvtier_"):
            exposed.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    assert len(exposed) >= 40  # every subsystem registered (collectors, storage, loop, shadow, policy)
    missing = sorted(n for n in exposed if not re.search(rf"`{re.escape(n)}`", doc))
    assert not missing, f"served but not in dashboards/METRICS.md: {missing}"
