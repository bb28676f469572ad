"""The shipped Grafana dashboard and Prometheus alert rules (deploy/): their structure, and
the parser that finds the metric names they use (tests/promql.py). That each name is one
the server exports is tests/e2e/test_dashboards.py's check, against a real server."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.promql import (
    ALERTS,
    DASHBOARD,
    dashboard_expressions,
    exported,
    is_exported,
    metric_names,
    referenced_metrics,
    rule_expressions,
)

RULE_KEYS = {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
DURATION = re.compile(r"^(\d+(ms|[smhdwy]))+$")
SEVERITIES = {"critical", "warning", "info"}


@pytest.mark.parametrize(
    "expr, names",
    [
        ("up == 0", {"up"}),
        (
            'sum by (model) (rate(nv_inference_request_success{model=~"$model"}[$__rate_interval]'
            "))",
            {"nv_inference_request_success"},
        ),
        (
            "histogram_quantile(0.99, sum by (le) (rate(trec_x_us_bucket[5m])))",
            {"trec_x_us_bucket"},
        ),
        (
            "a_total / on (model, table) group_left sum by (model, table) (rate(b_total[1m]))"
            " > 1e3 and c offset 5m",
            {"a_total", "b_total", "c"},
        ),
        ('rate(trec_y{reason="internal", what!~"or|and"}[5m]) > 0', {"trec_y"}),
        ("label_values(nv_inference_request_success, model)", {"nv_inference_request_success"}),
        (
            "max(nv_cpu_utilization) unless bool max without (instance) (x:rule:sum)",
            {"nv_cpu_utilization", "x:rule:sum"},
        ),
    ],
)  # fmt: skip
def test_metric_names_are_found_in_promql(expr, names):
    assert metric_names(expr) == names


def test_the_exposition_parser_knows_histogram_series():
    text = (
        "# HELP h_us a histogram\n# TYPE h_us histogram\n"
        'h_us_bucket{le="1"} 2\nh_us_sum 3\nh_us_count 2\n'
        "# TYPE c_total counter\n"
        'c_total{model="m"} 1\n'
    )
    samples, families = exported(text)
    assert samples == {"h_us_bucket", "h_us_sum", "h_us_count", "c_total"}
    assert is_exported("h_us_bucket", samples, families) and is_exported("h_us", samples, families)
    assert is_exported("c_total", samples, families) and is_exported("up", samples, families)
    assert not is_exported("c_total_count", samples, families)
    assert not is_exported("nv_gpu_utilization", samples, families)


def test_the_dashboard_is_an_importable_grafana_dashboard():
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 30
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    assert doc["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    # no two panels overlap
    cells = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert "model" in variables
    assert all(metric_names(e) for _, e in dashboard_expressions(doc))


def test_the_alert_rules_are_a_valid_rules_file():
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    assert set(doc) == {"groups"}
    groups = doc["groups"]
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names)) and all(isinstance(n, str) and n for n in names)
    alerts = []
    for g in groups:
        assert set(g) <= {"name", "interval", "rules"} and g["rules"], g["name"]
        for r in g["rules"]:
            assert set(r) <= RULE_KEYS and {"alert", "expr", "for", "labels", "annotations"} <= set(
                r
            ), r
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", r["alert"]), r["alert"]
            assert isinstance(r["expr"], str) and metric_names(r["expr"]), r["alert"]
            assert DURATION.match(r["for"]), r["alert"]
            assert r["labels"]["severity"] in SEVERITIES, r["alert"]
            assert all(isinstance(v, str) for v in r["labels"].values()), r["alert"]
            assert set(r["annotations"]) >= {"summary", "description"}, r["alert"]
            assert all(isinstance(v, str) and v.strip() for v in r["annotations"].values())
            alerts.append(r["alert"])
    assert len(alerts) == len(set(alerts))
    assert all(metric_names(e) for _, e in rule_expressions(doc))


def test_dashboard_and_rules_cover_what_an_operator_watches():
    used = set(referenced_metrics())
    watched = {
        "nv_inference_request_success",  # throughput
        "nv_inference_request_duration_us",  # latency
        "nv_inference_queue_duration_us",
        "trec_cache_hits_total",  # hit rate
        "trec_cache_lookups_total",
        "trec_cache_default_answered_total",  # default answers by cause
        "trec_cache_default_not_found_total",
        "trec_python_calls_total",  # Python on the native path
        "trec_cache_dropped_total",  # insert-queue drops
        "trec_cache_bytes",  # memory
        "trec_table_bytes",
    }
    assert watched <= used, watched - used
