"""The operations kit (ops/): the Grafana dashboard JSON and the Prometheus files parse, every alert rule has what
Prometheus and Alertmanager need, and every metric name they use is one the code defines (the pool's registry, the
gateway's, the gateway's pool-health gauges, the tenants' names), so a renamed series breaks this test, not the operators' alerts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.metrics import REGISTRY, pool_health_exposition, tenant_info_exposition
from loraplex.pool.metrics import PoolMetrics
from loraplex.service.pool_health import PoolHealth

OPS = Path(__file__).resolve().parents[2] / "ops"
METRIC = re.compile(r"\bloraplex_[a-z0-9_]+")


def _defined_names() -> set[str]:
    """Every sample name the code exposes (counters' _total, histograms' _bucket/_sum/_count included): the families of
    the pool's and the gateway's registries, and the pool-health gauges the gateway adds at a scrape."""
    pool = PoolMetrics("p")
    names = set()
    for registry in (pool.registry, REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + suffix for suffix in ("_total", "_bucket", "_sum", "_count"))
    health = pool_health_exposition([PoolHealth("p", True, "", heartbeat_age_s=1.0)]).decode()
    names.update(family.name for family in text_string_to_metric_families(health))
    info = tenant_info_exposition([("t-1", "acme")]).decode()
    names.update(family.name for family in text_string_to_metric_families(info))
    return names


def _exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((OPS / "grafana" / "loraplex.json").read_text())
    out = [(f"grafana: {p['title']}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


def test_every_metric_the_kit_uses_exists_in_the_code() -> None:
    defined = _defined_names()
    used = {(where, name) for where, expr in _exprs() for name in METRIC.findall(expr)}
    assert used
    missing = sorted((where, name) for where, name in used if name not in defined)
    assert not missing, missing


def test_the_files_parse_and_each_rule_is_complete() -> None:
    rules = yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {"LoraplexPoolDown", "LoraplexQueueRising", "LoraplexGateway5xx", "LoraplexCheckpointDiskLow"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and re.fullmatch(r"\d+[smh]", rule["for"]), name
    for where, expr in _exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), where
    config = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    assert {c["metrics_path"] for c in config["scrape_configs"]} == {"/metrics", "/metrics/pools"}
    dashboard = json.loads((OPS / "grafana" / "loraplex.json").read_text())
    assert dashboard["uid"] and all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
