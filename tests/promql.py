"""The metric names a Grafana dashboard or Prometheus rules file asks for, and the names a
server exports (tests/unit/test_dashboards.py, tests/e2e/test_dashboards.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "triton-rec.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

#: series Prometheus itself records for every scrape target (not exported by a server)
PROMETHEUS_SERIES = {"up"}
#: PromQL words that are not metric names: operators, modifiers, special values
KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip
#: suffixes of the series of a histogram or summary family
FAMILY_SUFFIXES = ("_bucket", "_sum", "_count")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'|`[^`]*`")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*")
_GRAFANA_VARIABLE = re.compile(r"\$\{?[A-Za-z0-9_]+\}?")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\(\s*(?P<selector>[^,()]+(?:\{[^}]*\})?)\s*,")


def metric_names(expr: str) -> Set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names and
    values, durations and Grafana variables left out). A Grafana ``label_values(metric,
    label)`` query gives its metric."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group("selector")
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", "[]", text)  # ranges and subqueries
    text = _GRAFANA_VARIABLE.sub("", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        rest = text[match.end() :].lstrip()
        word = match.group(0)
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue  # a function call, or an operator
        names.add(word)
    return names


def dashboard_expressions(doc: dict) -> Iterator[Tuple[str, str]]:
    """``(where, expression)`` of every PromQL query of a dashboard: each panel's targets
    (rows' panels too) and each query variable."""

    def panels(items: List[dict]) -> Iterator[dict]:
        for p in items:
            yield p
            yield from panels(p.get("panels") or [])

    for p in panels(doc.get("panels") or []):
        for t in p.get("targets") or []:
            yield f"panel '{p.get('title')}' {t.get('refId')}", t["expr"]
    for v in (doc.get("templating") or {}).get("list") or []:
        if v.get("type") == "query":
            q = v.get("query")
            yield f"variable '{v['name']}'", q["query"] if isinstance(q, dict) else q


def rule_expressions(doc: dict) -> Iterator[Tuple[str, str]]:
    """``(where, expression)`` of every rule of a Prometheus rules file."""
    for g in doc.get("groups") or []:
        for r in g.get("rules") or []:
            yield f"rule '{r.get('alert') or r.get('record')}'", str(r["expr"])


def referenced_metrics() -> Dict[str, Set[str]]:
    """Every metric name the shipped dashboard and alert rules use -> where."""
    out: Dict[str, Set[str]] = {}
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for where, expr in [*dashboard_expressions(dash), *rule_expressions(rules)]:
        for name in metric_names(expr):
            out.setdefault(name, set()).add(where)
    return out


def exported(text: str) -> Tuple[Set[str], Dict[str, str]]:
    """``(sample names, {family: type})`` of a Prometheus text exposition."""
    samples: Set[str] = set()
    families: Dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            families[name] = kind.strip()
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return samples, families


def is_exported(name: str, samples: Set[str], families: Dict[str, str]) -> bool:
    """Whether ``name`` is a series of the exposition: a sample name, a family, or a
    histogram/summary family's ``_bucket``/``_sum``/``_count`` series."""
    if name in samples or name in families or name in PROMETHEUS_SERIES:
        return True
    for suffix in FAMILY_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base) in ("histogram", "summary"):
            return True
    return False
