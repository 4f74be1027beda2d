"""The provisioned Grafana dashboard and the Prometheus scrape config match what the services export: every metric
a panel queries is one loraplane defines, and Prometheus scrapes each service on the port compose gives it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def exported_metric_names() -> set[str]:
    """Names from loraplane.metrics (counters and histograms with their series suffixes) and the scrape-time
    gauges the service servers register."""
    from prometheus_client import Counter, Histogram

    from loraplane import metrics

    names = set()
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names.add(value._name + "_total")
        elif isinstance(value, Histogram):
            names.update(value._name + suffix for suffix in ("_bucket", "_count", "_sum"))
    for server in ("trainer_svc/server.py", "sampler_svc/server.py"):
        names.update(re.findall(r'"(loraplane_[a-z_]+)"', (ROOT / server).read_text()))
    return names


def test_every_panel_queries_metrics_the_services_export():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/loraplane.json").read_text())
    exported = exported_metric_names()
    assert len(dashboard["panels"]) >= 12
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used = set(re.findall(r"\bloraplane_[a-z_]+", target["expr"]))
            assert used, panel["title"]
            assert used <= exported, (panel["title"], used - exported)


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    port = compose["x-loraplane-env"]["LORAPLANE_METRICS_PORT"]
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    # The gRPC services (the HTTP gateway shares their environment but serves no Prometheus endpoint).
    grpc_services = {name for name, s in compose["services"].items() if "LORAPLANE_REDIS_URL" in (
        s.get("environment") or {}) and "gateway_svc" not in s.get("command", [])}
    assert targets == {f"{name}:{port}" for name in grpc_services}
    grafana = compose["services"]["grafana"]
    assert any(v.startswith("./deploy/grafana/dashboards:") for v in grafana["volumes"])
