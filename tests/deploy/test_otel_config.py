"""deploy/otel/collector.yml in the form current collectors accept: the collector's own metrics through
``service.telemetry.metrics.readers`` (the ``address`` key is rejected from v0.123 on). No collector binary is
installable here (not in Debian or PyPI), so this reads the file's structure."""

from __future__ import annotations

from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "deploy" / "otel" / "collector.yml"


def test_collector_self_metrics_use_readers_not_address() -> None:
    doc = yaml.safe_load(CONF.read_text())
    metrics = doc["service"]["telemetry"]["metrics"]
    assert "address" not in metrics
    (reader,) = metrics["readers"]
    assert reader["pull"]["exporter"]["prometheus"] == {"host": "0.0.0.0", "port": 8888}
    pipes = doc["service"]["pipelines"]["traces"]
    assert set(pipes["receivers"]) <= set(doc["receivers"])
    assert set(pipes["exporters"]) <= set(doc["exporters"])
