"""The chart's NetworkPolicies and the proxy's metrics port (issue 15): the policies'
shape per values, no rule that would admit everyone, their ports the containers' ports,
the values schema refusing unknown keys, and the real API server accepting (and, for a
malformed policy, refusing) them. No CNI runs here, so nothing is enforced: what is
checked is what the chart asks a CNI to enforce.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolegate_cli.controlplane import ControlPlane

from .conftest import CHART, KUBE_VERSION, find, fullname, helm, render, render_text

RELEASE = "demo"  # fullname "demo-rolegate"
NS = "apps"
NETPOL = CHART / "ci" / "netpol-values.yaml"

Docs = list[dict[str, Any]]

DNS_PORTS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
KUBE_DNS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
CALLERS = {"namespaceSelector": {"matchLabels": {"rolegate.dev/caller": "true"}}}
RELEASE_NAMESPACE: dict[str, Any] = {"podSelector": {}}


def tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def policy(docs: Docs, component: str) -> dict[str, Any]:
    found = find(docs, "NetworkPolicy", f"{fullname(RELEASE)}-{component}", NS)
    assert found["apiVersion"] == "networking.k8s.io/v1"
    spec: dict[str, Any] = found["spec"]
    return spec


def selector(docs: Docs, component: str) -> dict[str, Any]:
    deployment = find(docs, "Deployment", f"{fullname(RELEASE)}-{component}", NS)
    labels: dict[str, Any] = deployment["spec"]["selector"]
    return labels


def container_ports(docs: Docs, component: str) -> dict[str, int]:
    deployment = find(docs, "Deployment", f"{fullname(RELEASE)}-{component}", NS)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def cluster_egress(cidrs: list[str], ports: list[int], *dns: dict[str, Any]) -> list[Any]:
    return [
        {"to": [KUBE_DNS, *dns], "ports": DNS_PORTS},
        {"to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs], "ports": tcp(*ports)},
    ]


# 1. The shape per values ------------------------------------------------------------------


def test_the_default_policies() -> None:
    """On by default: the proxy's API from the release namespace and the labelled
    callers' namespaces, its metrics port from `monitoring`; egress to DNS, the API
    server and any address on 443. The operator: metrics and health from `monitoring`,
    egress to DNS and the API server only."""
    docs = render(RELEASE, NS)
    default_egress = cluster_egress(["0.0.0.0/0"], [443, 6443])
    assert policy(docs, "proxy") == {
        "podSelector": selector(docs, "proxy"),
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [
            {"from": [RELEASE_NAMESPACE, CALLERS], "ports": tcp(8080)},
            {"from": [MONITORING], "ports": tcp(9090)},
        ],
        "egress": [*default_egress, {"ports": tcp(443)}],
    }
    assert policy(docs, "operator") == {
        "podSelector": selector(docs, "operator"),
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [MONITORING], "ports": tcp(8081, 8082)}],
        "egress": default_egress,
    }


def test_every_kind_of_value() -> None:
    """ci/netpol-values.yaml: selectors with expressions (the default's label dropped with
    null, as values.yaml says), extra pod and address peers, Prometheus by pod, NodeLocal
    DNSCache, the API server's endpoint, an in-cluster provider with a port range."""
    docs = render(RELEASE, NS, [NETPOL])
    observability = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}
    }
    prometheus = {
        **MONITORING,
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    egress = cluster_egress(["172.18.0.2/32"], [6443], {"ipBlock": {"cidr": "169.254.20.10/32"}})
    vllm = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference"}},
                "podSelector": {"matchLabels": {"app": "vllm"}},
            }
        ],
        "ports": [*tcp(8000), {"port": 9000, "endPort": 9010, "protocol": "TCP"}],
    }
    assert policy(docs, "proxy")["ingress"] == [
        {
            "from": [
                RELEASE_NAMESPACE,
                {
                    "namespaceSelector": {
                        "matchLabels": {"team": "search"},
                        "matchExpressions": [
                            {"key": "environment", "operator": "In", "values": ["prod", "staging"]}
                        ],
                    }
                },
                {"podSelector": {"matchLabels": {"app": "gateway"}}},
                {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.99.0/24"]}},
            ],
            "ports": tcp(8080),
        },
        {"from": [observability, prometheus], "ports": tcp(9090)},
    ]
    collector = {"to": [observability], "ports": tcp(4318)}
    assert policy(docs, "proxy")["egress"] == [*egress, {"ports": tcp(443)}, vllm, collector]
    assert policy(docs, "operator")["ingress"] == [
        {"from": [observability, prometheus], "ports": tcp(8081, 8082)}
    ]
    assert policy(docs, "operator")["egress"] == egress


def test_a_selector_given_adds_to_the_defaults_labels() -> None:
    """Helm merges maps, as values.yaml warns: a label given is required as well as the
    default's, unless the default's is set to null."""
    added = render(RELEASE, NS, sets=["networkPolicy.apiFrom.namespaceSelector.matchLabels.team=a"])
    both = {"matchLabels": {"rolegate.dev/caller": "true", "team": "a"}}
    assert policy(added, "proxy")["ingress"][0]["from"][1] == {"namespaceSelector": both}
    replaced = render(
        RELEASE, NS,
        sets=[
            "networkPolicy.apiFrom.namespaceSelector.matchLabels.team=a",
            "networkPolicy.apiFrom.namespaceSelector.matchLabels.rolegate\\.dev/caller=null",
        ],
    )  # fmt: skip
    only = {"matchLabels": {"team": "a"}}
    assert policy(replaced, "proxy")["ingress"][0]["from"][1] == {"namespaceSelector": only}


# 2. No rule admits everyone ----------------------------------------------------------------

CLOSED = [
    "networkPolicy.apiFrom.releaseNamespace=false",
    "networkPolicy.apiFrom.namespaceSelector=null",
    "networkPolicy.metricsFrom.namespaceSelector=null",
]


@pytest.mark.parametrize(
    ("sets", "proxy_from", "operator_from"),
    [
        ([], [[RELEASE_NAMESPACE, CALLERS], [MONITORING]], [[MONITORING]]),
        (CLOSED[:1], [[CALLERS], [MONITORING]], [[MONITORING]]),
        (CLOSED[:2], [[MONITORING]], [[MONITORING]]),
        (CLOSED[1:], [[RELEASE_NAMESPACE]], []),
        (CLOSED, [], []),
    ],
    ids=["default", "no-release-namespace", "metrics-only", "api-release-only", "closed"],
)
def test_a_rule_without_peers_is_left_out(
    sets: list[str], proxy_from: list[Any], operator_from: list[Any]
) -> None:
    """A NetworkPolicy rule without `from` admits every source: when the values leave a
    port no peer, its rule is left out (nobody may reach it), never rendered empty."""
    docs = render(RELEASE, NS, sets=sets)
    for component, expected in (("proxy", proxy_from), ("operator", operator_from)):
        ingress = policy(docs, component)["ingress"]
        assert [rule["from"] for rule in ingress] == expected, component
        assert "Ingress" in policy(docs, component)["policyTypes"]


@pytest.mark.parametrize("values", [[], [NETPOL]], ids=["default", "netpol"])
def test_only_the_provider_rules_leave_a_destination_open(values: list[Path]) -> None:
    """Every ingress rule names its sources and its ports; every egress rule names its
    ports, and only providerEgress's may leave the destination open."""
    docs = render(RELEASE, NS, values)
    provider_rules = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"][
        "providerEgress"
    ]
    if values:
        provider_rules = yaml.safe_load(NETPOL.read_text())["networkPolicy"]["providerEgress"]
    for component in ("proxy", "operator"):
        spec = policy(docs, component)
        for rule in spec["ingress"]:
            assert rule["from"], (component, rule)
            assert rule["ports"], (component, rule)
        for rule in spec["egress"]:
            assert rule["ports"], (component, rule)
            if not rule.get("to"):
                assert component == "proxy", rule
                assert rule in provider_rules, rule


def test_switched_off_there_is_no_policy() -> None:
    docs = render(RELEASE, NS, sets=["networkPolicy.enabled=false"])
    assert [d for d in docs if d["kind"] == "NetworkPolicy"] == []


def test_dns_without_a_resolver_is_refused() -> None:
    result = template_failing(
        "--set", "networkPolicy.dns.namespaceSelector=null",
        "--set", "networkPolicy.dns.podSelector=null",
    )  # fmt: skip
    assert result.returncode != 0
    assert "networkPolicy.dns: name the resolver" in result.stderr, result.stderr


# 3. Ports: the policies', the containers', the Service's, the ServiceMonitor's --------------


def test_the_policies_admit_the_containers_ports() -> None:
    """The proxy's API rule is the `http` container port, its metrics rule the `metrics`
    port, which the probes, the Service's `metrics` port and the ServiceMonitor use."""
    docs = render(RELEASE, NS, sets=["proxy.metrics.serviceMonitor.enabled=true"])
    proxy = container_ports(docs, "proxy")
    assert proxy == {"http": 8080, "metrics": 9090}
    api_rule, metrics_rule = policy(docs, "proxy")["ingress"]
    assert api_rule["ports"] == tcp(proxy["http"])
    assert metrics_rule["ports"] == tcp(proxy["metrics"])
    assert metrics_rule["from"] == [MONITORING]

    deployment = find(docs, "Deployment", f"{fullname(RELEASE)}-proxy", NS)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--metrics-port") + 1] == str(proxy["metrics"])
    assert args[args.index("--port") + 1] == str(proxy["http"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics", probe

    service = find(docs, "Service", f"{fullname(RELEASE)}-proxy", NS)
    by_name = {port["name"]: port for port in service["spec"]["ports"]}
    assert by_name["metrics"]["targetPort"] == "metrics"
    assert by_name["http"]["targetPort"] == "http"
    monitor = find(docs, "ServiceMonitor", f"{fullname(RELEASE)}-proxy", NS)
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    operator = container_ports(docs, "operator")
    assert policy(docs, "operator")["ingress"][0]["ports"] == tcp(
        operator["healthz"], operator["metrics"]
    )


# 4. The values schema ------------------------------------------------------------------------


def template_failing(*args: str) -> subprocess.CompletedProcess[str]:
    return helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION, *args, check=False)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"networkPolicy": {"enable": False}}, "enable"),
        ({"networkPolicy": {"apiFrom": {"namespaceSelecter": {}}}}, "namespaceSelecter"),
        ({"networkPolicy": {"apiFrom": {"extraPeers": [{"podSelectr": {}}]}}}, "podSelectr"),
        (
            {"networkPolicy": {"metricsFrom": {"namespaceSelector": {"matchLabel": {}}}}},
            "matchLabel",
        ),
        ({"networkPolicy": {"dns": {"port": 53}}}, "port"),
        ({"networkPolicy": {"apiServer": {"cidr": ["10.0.0.1/32"]}}}, "cidr"),
        ({"networkPolicy": {"providerEgress": [{"too": [], "ports": [{"port": 1}]}]}}, "too"),
        (
            {"networkPolicy": {"providerEgress": [{"ports": [{"port": 1, "proto": "TCP"}]}]}},
            "proto",
        ),
        (
            {
                "networkPolicy": {
                    "apiFrom": {"extraPeers": [{"ipBlock": {"cidr": "10.0.0.0/8", "exclude": []}}]}
                }
            },
            "exclude",
        ),
    ],
)
def test_the_schema_refuses_an_unknown_network_policy_key(
    values: dict[str, Any], named: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    result = template_failing("--values", str(bad))
    assert result.returncode != 0
    assert f"'{named}'" in result.stderr, result.stderr
    assert "additional properties" in result.stderr.lower(), result.stderr


@pytest.mark.parametrize(
    ("values", "where"),
    [
        # A provider rule without ports would open every port.
        ({"providerEgress": [{"to": [{"podSelector": {}}]}]}, "/networkPolicy/providerEgress/0"),
        ({"providerEgress": [{"ports": []}]}, "/networkPolicy/providerEgress/0/ports"),
        ({"apiServer": {"cidrs": []}}, "/networkPolicy/apiServer/cidrs"),
        ({"apiServer": {"cidrs": ["10.0.0.1"]}}, "/networkPolicy/apiServer/cidrs/0"),
        ({"apiServer": {"ports": [0]}}, "/networkPolicy/apiServer/ports/0"),
        ({"apiFrom": {"extraPeers": [{}]}}, "/networkPolicy/apiFrom/extraPeers/0"),
        # An ipBlock stands alone in a peer (the API server would refuse it).
        (
            {"apiFrom": {"extraPeers": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
            "/networkPolicy/apiFrom/extraPeers/0",
        ),
        (
            {
                "metricsFrom": {
                    "namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}
                }
            },
            "/networkPolicy/metricsFrom/namespaceSelector/matchExpressions/0/operator",
        ),
    ],
)
def test_the_schema_refuses_a_policy_value_that_would_open_or_break_it(
    values: dict[str, Any], where: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump({"networkPolicy": values}))
    result = template_failing("--values", str(bad))
    assert result.returncode != 0
    assert where in result.stderr, result.stderr


# 5. The API server -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "sets"),
    [([], []), ([NETPOL], []), ([], CLOSED)],
    ids=["default", "netpol", "closed"],
)
def test_the_api_server_accepts_the_policies(
    values: list[Path], sets: list[str], chart_cluster: ControlPlane, namespace: str
) -> None:
    """Stored by the real API server (its NetworkPolicy validation), read back as
    rendered: nothing dropped or defaulted away."""
    text = render_text("np", namespace, values, sets)
    policies = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "NetworkPolicy"]
    assert len(policies) == 2
    listing = {"apiVersion": "v1", "kind": "List", "items": policies}
    chart_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(listing))
    for rendered in policies:
        stored = json.loads(
            chart_cluster.kubectl(
                "get", "networkpolicy", rendered["metadata"]["name"], "-n", namespace, "-o", "json"
            ).stdout
        )
        # Stored without an empty list: `ingress: []` reads back absent, and with
        # policyTypes Ingress both mean the same, nobody admitted.
        stored["spec"].setdefault("ingress", [])
        for rule in stored["spec"]["ingress"] + stored["spec"].get("egress", []):
            for port in rule.get("ports", []):
                port.setdefault("protocol", "TCP")
        assert stored["spec"] == rendered["spec"]


def test_the_api_server_refuses_a_malformed_policy(
    chart_cluster: ControlPlane, namespace: str
) -> None:
    """The negative control of the test above: the API server does validate NetworkPolicy
    (an ipBlock beside a selector in one peer, which the values schema refuses too)."""
    (rendered,) = [
        d
        for d in yaml.safe_load_all(render_text("np", namespace))
        if d and d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-proxy")
    ]
    rendered["spec"]["ingress"][0]["from"].append(
        {"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}
    )
    result = chart_cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(rendered), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "ipBlock" in result.stderr, result.stderr
