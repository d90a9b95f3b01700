"""deploy/monitoring/: the Grafana dashboard and the Prometheus alerts. Every query parses as PromQL (promql-parser,
the Prometheus grammar) and every specdec_* metric it reads is one the processes export, so a renamed metric
fails here instead of leaving an empty panel or an alert that can never fire."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

promql = pytest.importorskip("promql_parser")

MONITORING = Path(__file__).resolve().parents[1] / "deploy" / "monitoring"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported() -> set[str]:
    """Every series name the coordinator, draft and target registries export (counters with `_total`,
    histograms with their bucket / sum / count series)."""
    from prometheus_client import CollectorRegistry

    from coordinator.metrics import CoordinatorMetrics
    from specdec_rpc.metrics import ServiceMetrics

    registry = CollectorRegistry()
    CoordinatorMetrics(ServiceMetrics(registry).registry)
    names = set()
    for mf in registry.collect():
        if mf.type == "counter":
            names.add(mf.name + "_total")
        elif mf.type == "histogram":
            names.update(mf.name + s for s in HISTOGRAM_SERIES)
        else:
            names.add(mf.name)
    return names


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def rules() -> list[dict]:
    doc = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target and every alert; Grafana's $__rate_interval as a range."""
    out = [(f"panel {p['title']!r}", t["expr"].replace("$__rate_interval", "5m"))
           for p in dashboard()["panels"] for t in p.get("targets", [])]
    return out + [(f"alert {r['alert']}", r["expr"]) for r in rules()]


def test_every_query_parses_and_reads_exported_metrics():
    names = exported()
    used = set()
    for where, expr in queries():
        try:
            promql.parse(expr)
        except ValueError as e:
            pytest.fail(f"{where}: {e}\n{expr}")
        found = set(re.findall(r"\bspecdec_[a-z0-9_]+", expr))
        assert found <= names, (where, sorted(found - names))
        used |= found
    assert len(used) >= 15, "the dashboard and alerts read most of what the service exports"


def test_the_dashboard_is_importable():
    d = dashboard()
    panels = d["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in d["templating"]["list"])
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_every_alert_says_what_to_do():
    seen = set()
    for r in rules():
        assert r["alert"].startswith("Specdec") and r["alert"] not in seen, r["alert"]
        seen.add(r["alert"])
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 40, r["alert"]


def test_the_dashboard_shows_vllms_speculation_series_and_what_only_specdec_has():
    """The vLLM-ported spec-decode series and the disaggregated stack's own are on the dashboard, and the
    alerts watch acceptance, PACER's stops, PEARL's overlap and the network on their new series."""
    panels = {name for _, expr in queries() if _.startswith("panel") for name in re.findall(r"\bspecdec_[a-z0-9_]+",
                                                                                           expr)}
    alerts = {name for _, expr in queries() if _.startswith("alert") for name in re.findall(r"\bspecdec_[a-z0-9_]+",
                                                                                           expr)}
    ported = {f"specdec_spec_decode_num_{n}_total" for n in ("drafts", "draft_tokens", "accepted_tokens",
                                                            "accepted_tokens_per_pos")}
    ours = {"specdec_pacer_false_stops_total", "specdec_pacer_false_continues_total",
            "specdec_overlap_draft_idle_seconds_total", "specdec_overlap_target_idle_seconds_total",
            "specdec_request_network_seconds_bucket"}
    assert ported | ours <= panels, sorted((ported | ours) - panels)
    assert {"specdec_spec_decode_num_accepted_tokens_total", "specdec_pacer_false_stops_total",
            "specdec_overlap_target_idle_seconds_total", "specdec_request_network_seconds_bucket"} <= alerts
