"""The chart's Grafana dashboard and PrometheusRule: the dashboard ConfigMap is accepted by
the real API server; every query and alert names only series the proxy and the operator
really export, with labels they really carry; promtool (built with the control plane,
`make control-plane`) accepts every expression; and promtool's rule unit tests show the
alerts fire on the series they are about, and stay quiet otherwise.

What is exported is read from the real registries: the proxy app's (`create_app`, never
started) and the operator's.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from rolegate_cli.controlplane import ControlPlane, installed_promtool
from rolegate_operator.metrics import OperatorMetrics
from rolegate_policy.config import ProxyConfig
from rolegate_proxy.edge.app import create_app
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_proxy.edge.state import STATE

from .conftest import CHART, find, fullname, install, render

RELEASE = "demo"
NS = "apps"
PROXY = f'job="{fullname(RELEASE)}-proxy",namespace="{NS}"'
OPERATOR = f'job="{fullname(RELEASE)}-operator",namespace="{NS}"'
ENABLED = ("dashboards.enabled=true", "prometheusRule.enabled=true")
DASHBOARD_FILE = CHART / "dashboards" / "rolegate.json"
# Labels Prometheus gives every series of a target the Prometheus Operator scrapes
# (ServiceMonitor relabelling), beside the ones the application exports.
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}
)
# The dashboard's variables, as a query Prometheus would get them.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$namespace": NS,
    "$proxy": f"{fullname(RELEASE)}-proxy",
    "$operator": f"{fullname(RELEASE)}-operator",
}
# What issue 18 asks the dashboard to show, as the series that show it.
DASHBOARD_MUST_SHOW = {
    "requests and errors by role and outcome": "rolegate_requests_total",
    "TTFT by machine": "rolegate_time_to_first_token_seconds_bucket",
    "total latency by machine": "rolegate_served_seconds_bucket",
    "breaker states": "rolegate_breaker_open",
    "trips by reason": "rolegate_breaker_transitions_total",
    "rate acts and moves": "rolegate_acts_total",
    "outcome-channel drops": "rolegate_outcomes_dropped_total",
    "config hash per pod": "rolegate_config_info",
}
ALERTS = (
    "RolegateBreakerOpen",
    "RolegateResourceRejected",
    "RolegateConfigHashDrift",
    "RolegateOutcomesDropped",
    "RolegateOutcomeExportDropped",
    "RolegateRoleErrorRatio",
)


# What the proxy and the operator export -----------------------------------------------------


@functools.cache
def exported() -> Mapping[str, frozenset[str]]:
    """Every series name the two components can serve, with the labels it carries."""
    proxy = create_app(ProxySettings(host="127.0.0.1", port=0), ProxyConfig())[STATE].metrics
    operator = OperatorMetrics()
    series: dict[str, frozenset[str]] = {}
    for owner, registry in ((proxy, proxy.registry), (operator, operator.registry)):
        labels = _labels_by_family(owner)
        for name, kind in _families(registry):
            names = {
                "counter": (f"{name}_total",),
                "histogram": (f"{name}_bucket", f"{name}_count", f"{name}_sum"),
            }.get(kind, (name,))
            for sample in names:
                extra = {"le"} if sample.endswith("_bucket") else set()
                series[sample] = labels.get(name, frozenset()) | extra
    return series


def _families(registry: CollectorRegistry) -> Iterator[tuple[str, str]]:
    page = generate_latest(registry).decode()
    for family in text_string_to_metric_families(page):
        yield family.name, family.type


def _labels_by_family(owner: object) -> dict[str, frozenset[str]]:
    """The label names of each labelled metric an owner (ProxyMetrics, OperatorMetrics)
    holds. prometheus_client has no public accessor for them; a family without samples
    (nothing observed yet) renders without its labels. The collectors read at scrape time
    (scores, allowances, the outcome counters) are not listed: a query naming a label of
    theirs fails the check, which is the safe way round."""
    found: dict[str, frozenset[str]] = {}
    for value in vars(owner).values():
        if isinstance(value, MetricWrapperBase):
            found[value._name] = frozenset(value._labelnames)
    return found


# Reading PromQL well enough to list what it names --------------------------------------------


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHER = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_METRIC = re.compile(r"\brolegate_[a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Named:
    metrics: frozenset[str]
    labels: frozenset[str]
    grouped: frozenset[str]


def named(expr: str) -> Named:
    """The metric names and label names a PromQL expression uses (promtool judges its
    syntax; this only lists names)."""
    # Strings emptied first: a matcher's value may hold anything, commas and braces too.
    unquoted = _STRING.sub('""', expr)
    matchers = [m for block in _MATCHER.findall(unquoted) for m in block.split(",") if m.strip()]
    labels = {re.split(r"=~|!~|!=|=", m, maxsplit=1)[0].strip() for m in matchers}
    # A dashboard variable's Grafana query: label_values(<selector>, <label>).
    if values_of := re.fullmatch(r"label_values\((.*),\s*(\w+)\s*\)", unquoted.strip()):
        labels.add(values_of.group(2))
    grouped = {
        name.strip()
        for block in _GROUPING.findall(unquoted)
        for name in block.split(",")
        if name.strip()
    }
    return Named(frozenset(_METRIC.findall(unquoted)), frozenset(labels), frozenset(grouped))


def problems(expr: str) -> list[str]:
    """What in `expr` the components do not export: unknown metrics, unknown labels."""
    series = exported()
    names = named(expr)
    if not names.metrics:
        return [f"names no rolegate metric: {expr}"]
    found = [f"unknown metric {metric}" for metric in sorted(names.metrics - series.keys())]
    known = set(TARGET_LABELS)
    for metric in names.metrics & series.keys():
        known |= series[metric]
    found += [
        f"label {label!r} is not on {sorted(names.metrics)}"
        for label in sorted((names.labels | names.grouped) - known)
    ]
    return found


def substituted(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


# The rendered objects ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(RELEASE, NS, sets=ENABLED)


@pytest.fixture(scope="module")
def dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    configmap = find(docs, "ConfigMap", f"{fullname(RELEASE)}-dashboard", NS)
    loaded: dict[str, Any] = json.loads(configmap["data"]["rolegate.json"])
    return loaded


@pytest.fixture(scope="module")
def rule_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = find(docs, "PrometheusRule", fullname(RELEASE), NS)
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


@pytest.fixture(scope="module")
def promtool() -> Path:
    """The real promtool. Missing, the test fails and says to run `make control-plane`."""
    return installed_promtool()


def run_promtool(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), *args], capture_output=True, text=True, timeout=60, check=False
    )


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, query) for every panel target and every query variable."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"${variable['name']}", variable["query"]["query"]


def alert_rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"]]


# 1. Off by default; the dashboard ConfigMap -------------------------------------------------


def test_off_by_default() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render(RELEASE, NS)}
    assert ("PrometheusRule", fullname(RELEASE)) not in kinds
    assert ("ConfigMap", f"{fullname(RELEASE)}-dashboard") not in kinds


def test_the_dashboard_configmap_is_accepted_by_the_api_server(
    chart_cluster: ControlPlane, namespace: str
) -> None:
    """Applied for real (server-side), read back: the sidecar's label is on it and the
    dashboard in it is the chart's file, byte for byte."""
    docs = render(
        RELEASE, namespace,
        sets=(*ENABLED, "dashboards.label=grafana_dashboard_rolegate", "dashboards.labelValue=yes"),
    )  # fmt: skip
    configmap = find(docs, "ConfigMap", f"{fullname(RELEASE)}-dashboard", namespace)
    chart_cluster.kubectl(
        "apply", "--server-side", "--field-manager=chart-test", "-f", "-",
        input=json.dumps(configmap),
    )  # fmt: skip
    stored = json.loads(
        chart_cluster.kubectl(
            "get", "configmap", f"{fullname(RELEASE)}-dashboard", "-n", namespace, "-o", "json"
        ).stdout
    )
    assert stored["metadata"]["labels"]["grafana_dashboard_rolegate"] == "yes"
    assert stored["data"]["rolegate.json"] == DASHBOARD_FILE.read_text().rstrip("\n")
    assert json.loads(stored["data"]["rolegate.json"])["uid"] == "rolegate-overview"


def test_the_prometheus_rule_is_accepted_by_the_api_server(
    chart_cluster: ControlPlane, namespace: str
) -> None:
    rule = find(
        render(RELEASE, namespace, sets=ENABLED), "PrometheusRule", fullname(RELEASE), namespace
    )
    result = chart_cluster.kubectl(
        "apply", "--server-side", "--field-manager=chart-test", "-f", "-",
        input=json.dumps(rule),
    )  # fmt: skip
    assert "serverside-applied" in result.stdout, result.stdout


def test_an_install_with_both_says_where_they_are(
    chart_cluster: ControlPlane, namespace: str
) -> None:
    release = f"mon-{uuid.uuid4().hex[:8]}"
    notes = install(chart_cluster, release, namespace, sets=ENABLED).stdout
    assert f"ConfigMap {namespace}/{fullname(release)}-dashboard" in notes, notes
    assert f'proxy:    job="{fullname(release)}-proxy",namespace="{namespace}"' in notes, notes
    # Both stored by the API server (`get` fails on a missing object).
    chart_cluster.kubectl("get", "prometheusrule", fullname(release), "-n", namespace)
    chart_cluster.kubectl("get", "configmap", f"{fullname(release)}-dashboard", "-n", namespace)


def test_the_dashboard_namespace_and_annotations_are_values() -> None:
    docs = render(
        RELEASE, NS,
        sets=(*ENABLED, "dashboards.namespace=grafana",
              "dashboards.annotations.grafana_folder=llm"),
    )  # fmt: skip
    configmap = find(docs, "ConfigMap", f"{fullname(RELEASE)}-dashboard", "grafana")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "llm"}


# 2. Every query names only what is exported ------------------------------------------------


def test_the_exported_series_are_read_from_the_real_registries() -> None:
    """The check below is only as good as this list: it holds both components' series."""
    series = exported()
    assert series["rolegate_requests_total"] == {"role", "status", "outcome"}
    assert series["rolegate_operator_rejected_resources"] == {"kind"}
    assert "rolegate_outcomes_dropped_total" in series
    assert "le" in series["rolegate_served_seconds_bucket"]


def test_the_dashboard_queries_name_only_exported_series(dashboard: dict[str, Any]) -> None:
    found = [
        f"{title}: {problem}"
        for title, query in panel_queries(dashboard)
        for problem in problems(substituted(query))
    ]
    assert found == []


def test_the_dashboard_legends_name_labels_the_query_keeps(dashboard: dict[str, Any]) -> None:
    """A legend `{{machine}}` on a query that sums the machine away would be blank."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            kept = named(target["expr"]).grouped
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                if label not in kept:
                    found.append(f"{panel['title']}: legend {label} not in by ({sorted(kept)})")
    assert found == []


def test_the_dashboard_shows_what_the_issue_asks(dashboard: dict[str, Any]) -> None:
    used = {metric for _, query in panel_queries(dashboard) for metric in named(query).metrics}
    missing = [what for what, metric in DASHBOARD_MUST_SHOW.items() if metric not in used]
    assert missing == []
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_alerts_name_only_exported_series(rule_groups: list[dict[str, Any]]) -> None:
    rules = alert_rules(rule_groups)
    assert [rule["alert"] for rule in rules] == list(ALERTS)
    found = [f"{rule['alert']}: {p}" for rule in rules for p in problems(rule["expr"])]
    assert found == []


def test_the_alerts_select_the_release_by_default_and_by_values(
    rule_groups: list[dict[str, Any]],
) -> None:
    by_name = {rule["alert"]: rule["expr"] for rule in alert_rules(rule_groups)}
    assert PROXY in by_name["RolegateBreakerOpen"]
    assert OPERATOR in by_name["RolegateResourceRejected"]
    chosen = render(
        RELEASE, NS,
        sets=(*ENABLED, 'prometheusRule.proxySelector=job="llm-proxy"',
              "prometheusRule.breakerOpen.for=3m"),
    )  # fmt: skip
    rule = find(chosen, "PrometheusRule", fullname(RELEASE), NS)
    breaker = alert_rules(rule["spec"]["groups"])[0]
    assert 'rolegate_breaker_open{job="llm-proxy"}' in breaker["expr"]
    assert breaker["for"] == "3m"


# 3. promtool accepts every expression --------------------------------------------------------


def test_promtool_accepts_every_alert_rule(
    rule_groups: list[dict[str, Any]], promtool: Path, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups}))
    result = run_promtool(promtool, "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout, result.stdout


def test_promtool_accepts_every_dashboard_query(
    dashboard: dict[str, Any], promtool: Path, tmp_path: Path
) -> None:
    """Each query as a recording rule's expression, the variables as Grafana fills them."""
    records = [
        {"record": f"rolegate_dashboard:query_{index}", "expr": substituted(query)}
        for index, (_, query) in enumerate(panel_queries(dashboard))
        if not query.startswith("label_values(")  # Grafana's own function, not PromQL
    ]
    variables = [q for _, q in panel_queries(dashboard) if q.startswith("label_values(")]
    # label_values(<selector>, <label>): its selector is PromQL.
    records += [
        {
            "record": f"rolegate_dashboard:variable_{index}",
            "expr": q[len("label_values(") :].rsplit(",", 1)[0],
        }
        for index, q in enumerate(variables)
    ]
    rules = tmp_path / "dashboard.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    result = run_promtool(promtool, "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(records)} rules found" in result.stdout, result.stdout


# 4. The alerts fire on what they are about (promtool test rules) ----------------------------


PROXY_LABELS = {"job": f"{fullname(RELEASE)}-proxy", "namespace": NS}
OPERATOR_LABELS = {"job": f"{fullname(RELEASE)}-operator", "namespace": NS}
# Another release's proxies in the same Prometheus: the selector keeps them out.
OTHER_PROXY = {"job": "other-rolegate-proxy", "namespace": "other"}
MACHINE = {"provider": "openrouter", "model": "coder", "machine": "together"}
BREAKER = {**PROXY_LABELS, "pod": "a", **MACHINE, "cause": "Breaker"}


def series(name: str, labels: Mapping[str, str], values: str) -> dict[str, str]:
    """An input series in promtool's notation (`1x4`: 1 five times; `0+90x30`: rising by
    90 each interval; `_`: no sample)."""
    selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


@dataclass(frozen=True)
class Fired:
    """An alert expected: its labels and its summary as Prometheus expands it."""

    summary: str
    labels: Mapping[str, str]


# (time, alert, what has fired by then)
Eval = tuple[str, str, list[Fired]]


@dataclass(frozen=True)
class Case:
    name: str
    inputs: list[dict[str, str]]
    evals: tuple[Eval, ...]


def case(name: str, inputs: list[dict[str, str]], *evals: Eval) -> Case:
    return Case(name, inputs, evals)


# Each case: the input series, then (time, alert, what has fired by then).
CASES = (
    case(
        "a machine excluded past the threshold; another release's is not counted",
        [
            # Open, HalfOpen for a probe, Open again: excluded throughout.
            series("rolegate_breaker_open", {**BREAKER, "state": "Open"}, "1x4 _x2 1x10"),
            series("rolegate_breaker_open", {**BREAKER, "state": "HalfOpen"}, "_x4 1x2 _x10"),
            series("rolegate_breaker_open", {**OTHER_PROXY, **MACHINE, "state": "Open"}, "1x16"),
        ],
        ("5m", "RolegateBreakerOpen", []),
        (
            "12m",
            "RolegateBreakerOpen",
            [
                Fired(
                    "rolegate excludes openrouter coder together (Breaker)",
                    {"severity": "warning", "namespace": NS, "cause": "Breaker", **MACHINE},
                )
            ],
        ),
    ),
    case(
        "a rejected resource on the leader fires; a standby's stale figure does not",
        [
            series("rolegate_operator_leader", {**OPERATOR_LABELS, "pod": "op-a"}, "1x20"),
            series(
                "rolegate_operator_rejected_resources",
                {**OPERATOR_LABELS, "pod": "op-a", "kind": "ProviderPolicy"},
                "0x2 1x18",
            ),
            series("rolegate_operator_leader", {**OPERATOR_LABELS, "pod": "op-b"}, "0x20"),
            series(
                "rolegate_operator_rejected_resources",
                {**OPERATOR_LABELS, "pod": "op-b", "kind": "RoleTable"},
                "2x20",
            ),
        ],
        ("8m", "RolegateResourceRejected", []),
        (
            "13m",
            "RolegateResourceRejected",
            [
                Fired(
                    "1 rolegate ProviderPolicy(s) not accepted",
                    {"severity": "warning", "namespace": NS, "kind": "ProviderPolicy"},
                )
            ],
        ),
    ),
    case(
        "two hashes served past the threshold; a release whose pods converge is quiet",
        [
            series("rolegate_config_info", {**PROXY_LABELS, "pod": "a", "hash": "h1"}, "1x30"),
            series("rolegate_config_info", {**PROXY_LABELS, "pod": "b", "hash": "h2"}, "1x30"),
            series("rolegate_config_info", {**OTHER_PROXY, "pod": "c", "hash": "h3"}, "1x2"),
            series("rolegate_config_info", {**OTHER_PROXY, "pod": "d", "hash": "h4"}, "1x30"),
        ],
        ("10m", "RolegateConfigHashDrift", []),
        (
            "20m",
            "RolegateConfigHashDrift",
            [
                Fired(
                    f"rolegate proxies of {PROXY_LABELS['job']} serve 2 different configurations",
                    {"severity": "warning", **PROXY_LABELS},
                )
            ],
        ),
    ),
    case(
        "outcome records dropped, and ten minutes later no more",
        [
            series("rolegate_outcomes_dropped_total", {**PROXY_LABELS, "pod": "a"}, "0 0 0 46x20"),
            series("rolegate_outcome_export_dropped_total", {**PROXY_LABELS, "pod": "a"}, "0x23"),
        ],
        ("2m", "RolegateOutcomesDropped", []),
        (
            "5m",
            "RolegateOutcomesDropped",
            [
                Fired(
                    "rolegate proxy a dropped outcome records",
                    {"severity": "warning", "namespace": NS, "pod": "a"},
                )
            ],
        ),
        ("5m", "RolegateOutcomeExportDropped", []),
        ("20m", "RolegateOutcomesDropped", []),
    ),
    case(
        "one role fails 10 % of its requests, another 1 %",
        [
            series(
                "rolegate_requests_total",
                {**PROXY_LABELS, "pod": "a", "role": role, "status": status, "outcome": outcome},
                f"0+{per_minute}x30",
            )
            for role, status, outcome, per_minute in (
                ("coder", "200", "answered", 90),
                ("coder", "502", "failed", 10),
                ("chat", "200", "answered", 99),
                ("chat", "200", "incomplete", 1),
            )
        ],
        ("8m", "RolegateRoleErrorRatio", []),
        (
            "20m",
            "RolegateRoleErrorRatio",
            [
                Fired(
                    "rolegate role coder fails 10% of its requests",
                    {"severity": "critical", "namespace": NS, "role": "coder"},
                )
            ],
        ),
    ),
)


def promtool_tests(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CASES in promtool's test file format. An alert's annotations are compared whole:
    the description is the rule's own (it has no template), the summary the case's."""
    description = {
        rule["alert"]: rule["annotations"]["description"] for rule in alert_rules(groups)
    }
    return [
        {
            "name": test.name,
            "interval": "1m",
            "input_series": test.inputs,
            "alert_rule_test": [
                {
                    "eval_time": at,
                    "alertname": alert,
                    "exp_alerts": [
                        {
                            "exp_labels": dict(fired.labels),
                            "exp_annotations": {
                                "summary": fired.summary,
                                "description": description[alert],
                            },
                        }
                        for fired in expected
                    ],
                }
                for at, alert, expected in test.evals
            ],
        }
        for test in CASES
    ]


def test_the_alerts_fire_on_what_they_are_about(
    rule_groups: list[dict[str, Any]], promtool: Path, tmp_path: Path
) -> None:
    assert {alert for test in CASES for _, alert, _ in test.evals} == set(ALERTS)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": promtool_tests(rule_groups),
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = run_promtool(promtool, "test", "rules", str(tmp_path / "tests.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout
