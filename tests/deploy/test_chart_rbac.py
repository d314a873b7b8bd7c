"""The Helm chart's RBAC is least privilege, proven on the real control plane.

The chart is installed with `helm install` into a release namespace that watches a second
namespace too, so "each watched namespace" is real. Three proofs:

1. impersonation: `kubectl auth can-i --as=system:serviceaccount:...` answers yes for
   exactly what each component needs and no for a list of things it must not do, and
   `kubectl auth can-i --list` shows nothing granted beyond the expected rules;
2. the processes do their whole job as the chart's ServiceAccounts: the operator and the
   proxy run as local processes (no kubelet here, so Pods never run) with kubeconfigs
   holding TokenRequest tokens of those accounts, and nothing they do is Forbidden;
3. the very same tokens are refused what the chart does not grant.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane, free_port

from ..support import open_access, provider_policy, role, role_table
from ..waiting import wait_for
from .conftest import fullname, helm, install

T = TypeVar("T")

DOCS = REPO_ROOT / "docs" / "operator.md"
MODEL_HOME = "vendor/model-home"
MODEL_SECOND = "vendor/model-second"
# What a process logs when the API server refuses it (kopf's and the proxy's wording).
FORBIDDEN = re.compile(r"forbidden|HTTP 403|status=403|\(403\)", re.IGNORECASE)


# --- the release ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """One `helm install` of the chart, and kubectl around it."""

    plane: ControlPlane
    name: str
    namespace: str
    watched: tuple[str, ...]

    @property
    def fullname(self) -> str:
        return fullname(self.name)

    @property
    def proxy_account(self) -> str:
        return f"{self.fullname}-proxy"

    @property
    def operator_account(self) -> str:
        return f"{self.fullname}-operator"

    @property
    def configmap(self) -> str:
        return f"{self.fullname}-config"

    @property
    def lease(self) -> str:
        """The operator replicas' Lease (`--lease-name`), named like its account."""
        return f"{self.fullname}-operator"

    def subject(self, account: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{account}"

    def kubectl(self, *args: str, namespace: str | None = None, input: str | None = None) -> str:
        """kubectl as the cluster admin, in the release namespace unless told otherwise."""
        return self.plane.kubectl("-n", namespace or self.namespace, *args, input=input).stdout

    def json(self, *args: str, namespace: str | None = None) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.kubectl(*args, "-o", "json", namespace=namespace))
        return found

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl(
            "apply", "-f", "-", namespace=obj["metadata"]["namespace"], input=json.dumps(obj)
        )

    def helm(self, *args: str) -> str:
        return helm(*args, "--namespace", self.namespace, plane=self.plane).stdout

    def token_kubeconfig(self, account: str, path: Path) -> Path:
        """A kubeconfig holding only a TokenRequest token of `account` (what the kubelet
        projects into the pod): no admin credentials to fall back on."""
        return self.plane.service_account_kubeconfig(self.namespace, account, path)

    def as_token(
        self, kubeconfig: Path, *args: str, namespace: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """kubectl with only `kubeconfig`'s credentials."""
        return self.plane.kubectl(
            "--kubeconfig", str(kubeconfig), "-n", namespace or self.namespace, *args, check=False
        )


def fresh_namespace(plane: ControlPlane, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    plane.kubectl("create", "namespace", name)
    return name


def install_release(
    plane: ControlPlane, name: str, namespace: str, values: dict[str, Any], directory: Path
) -> Release:
    """`helm install NAME deploy/helm/rolegate -n NAMESPACE --values FILE`."""
    values_file = directory / f"values-{name}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    install(plane, name, namespace, values=[values_file])
    watched = tuple(values.get("watchNamespaces") or (namespace,))
    return Release(plane, name, namespace, watched)


# --- processes -----------------------------------------------------------------------------


def process_env(**extra: str) -> dict[str, str]:
    """The test's environment without the admin's KUBECONFIG and without any
    ROLEGATE_SECRET_* variable: a process gets only the credentials it is given."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "KUBECONFIG" and not key.startswith("ROLEGATE_SECRET_")
    }
    return {**env, **extra}


class Process:
    """A `rolegate` subcommand as a process; stdout and stderr go to a file (a full pipe
    would block it), read back as its log."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str]) -> None:
        self.args = list(args)
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rolegate_cli.main", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def environ(self) -> dict[str, str]:
        """The running process's environment, as the kernel holds it."""
        raw = Path(f"/proc/{self.pid}/environ").read_bytes().decode(errors="replace")
        return dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(
                f"`rolegate {' '.join(self.args[:3])}` exited with {self.process.returncode}:\n"
                f"{self.log()[-6000:]}"
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass(frozen=True)
class Pod:
    """What the chart's Deployment runs for one component: its one container, its pod
    spec, and the name the pod would have."""

    container: dict[str, Any]
    spec: dict[str, Any]
    name: str


def chart_pod(release: Release, component: str) -> Pod:
    deployment = release.json("get", "deployment", f"{release.fullname}-{component}")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["serviceAccountName"] == f"{release.fullname}-{component}"
    return Pod(container, spec, f"{release.fullname}-{component}-5d9c7b-x2x7q")


def kubelet_mounts(release: Release, pod: Pod, root: Path) -> None:
    """Materialise the container's Secret volumes under `root` exactly as the kubelet
    mounts them: the volume's directory at `root` + mountPath, one file per key (or per
    listed item) holding the decoded value. Read with the admin's kubectl: the component's
    own account cannot read Secrets, which is the point."""
    volumes = {volume["name"]: volume for volume in pod.spec.get("volumes") or ()}
    for mount in pod.container.get("volumeMounts") or ():
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue  # an emptyDir (/tmp): the local filesystem serves
        assert mount.get("readOnly") is True, f"a Secret mounted writable: {mount}"
        secret = release.json("get", "secret", source["secretName"])
        items = source.get("items") or [{"key": k, "path": k} for k in secret["data"]]
        directory = root / mount["mountPath"].lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        for item in items:
            (directory / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))


def chart_command(
    pod: Pod, root: Path, kubeconfig: Path, replace: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The container's `rolegate` arguments and environment, run locally: every absolute
    path is taken under `root` (the pod's filesystem, see `kubelet_mounts`), the values of
    the flags in `replace` are swapped (listen addresses), and `--kubeconfig` is added
    (the pod would use its projected token; the kubeconfig holds one of the same account)."""
    assert pod.container["command"] == ["rolegate"], pod.container["command"]
    args = [f"{root}{arg}" if arg.startswith("/") else arg for arg in pod.container["args"]]
    for flag, value in replace.items():
        assert flag in args, f"the chart passes no {flag}: {args}"
        args[args.index(flag) + 1] = value
    assert not pod.container.get("envFrom"), pod.container["envFrom"]
    env: dict[str, str] = {}
    for var in pod.container.get("env") or ():
        field_path = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if "value" in var:
            env[var["name"]] = var["value"]
        elif field_path == "metadata.name":
            env[var["name"]] = pod.name
        else:
            raise AssertionError(f"an environment variable from elsewhere: {var}")
    return [*args, "--kubeconfig", str(kubeconfig)], env


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_sim(models: Sequence[str], directory: Path) -> tuple[Process, str]:
    """`rolegate sim` serving each model on one machine `m1`; returns it and its URL."""
    scenario = directory / "scenario.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "seed": 1,
                "models": [
                    {"name": model, "machines": [{"name": "m1", "ttftSeconds": 0}]}
                    for model in models
                ],
            }
        )
    )
    port = free_port()
    sim = Process(
        ["sim", "--scenario", str(scenario), "--port", str(port)],
        directory / "sim.log",
        process_env(),
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: answers(f"{url}/healthz"), "the simulator to answer", alive=[sim])
    return sim, url


def set_faults(sim_url: str, model: str, faults: list[dict[str, Any]]) -> None:
    httpx.put(f"{sim_url}/_sim/machines/{model}/m1/faults", json=faults).raise_for_status()


def accepted(obj: dict[str, Any], status: str = "True") -> bool:
    """The object's Accepted condition has `status` for its current generation."""
    generation = obj["metadata"]["generation"]
    return any(
        c["type"] == "Accepted" and c["status"] == status and c["observedGeneration"] == generation
        for c in (obj.get("status") or {}).get("conditions") or ()
    )


# --- what `kubectl auth can-i` says --------------------------------------------------------

Grant = tuple[str, str, str]  # (resource as `can-i --list` names it, resource name, verb)


def can_i(release: Release, account: str, namespace: str, *question: str) -> bool:
    result = release.plane.kubectl(
        "auth", "can-i", *question, "-n", namespace, f"--as={release.subject(account)}",
        check=False,
    )  # fmt: skip
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"can-i {question}: {result.stdout!r} {result.stderr!r}"
    return answer == "yes"


def check_answers(
    release: Release,
    account: str,
    yes: Sequence[tuple[str, Sequence[str]]],
    no: Sequence[tuple[str, Sequence[str]]],
) -> None:
    """Every (namespace, question) of `yes` answers yes and every one of `no` answers no;
    all mismatches are reported at once."""
    wrong = [
        f"{'should' if expected else 'must not'}: {' '.join(question)} -n {namespace}"
        for expected, questions in ((True, yes), (False, no))
        for namespace, question in questions
        if can_i(release, account, namespace, *question) is not expected
    ]
    assert not wrong, f"{account}:\n" + "\n".join(wrong)


def listed(release: Release, subject: str, namespace: str) -> set[tuple[str, str, str, str]]:
    """`kubectl auth can-i --list` as (resource, non-resource URL, resource name, verb)."""
    table = release.plane.kubectl(
        "auth", "can-i", "--list", "-n", namespace, f"--as={subject}"
    ).stdout  # fmt: skip
    header, *rows = table.rstrip().splitlines()
    columns = ["Resources", "Non-Resource URLs", "Resource Names", "Verbs"]
    starts = [header.index(column) for column in columns]
    ends = [*starts[1:], None]
    found: set[tuple[str, str, str, str]] = set()
    for row in rows:
        resource, url, names, verbs = (row[s:e].strip() for s, e in zip(starts, ends, strict=True))
        for name in names.strip("[]").split() or [""]:
            for verb in verbs.strip("[]").split():
                found.add((resource, url.strip("[]"), name, verb))
    return found


def grants(release: Release, account: str, namespace: str) -> set[Grant]:
    """What `account` may do in `namespace` beyond what every authenticated user may do
    (the discovery and health URLs, the self-subject reviews): that baseline is read from
    an account with no binding at all, not assumed."""
    baseline = listed(release, release.subject(f"{release.fullname}-nobody"), namespace)
    assert all(url or resource.startswith("selfsubject") for resource, url, _, _ in baseline), (
        f"an unbound account should hold only the universal grants: {baseline}"
    )
    mine = listed(release, release.subject(account), namespace)
    extra = {(resource, name, verb) for resource, url, name, verb in mine - baseline}
    unexpected_urls = {g for g in extra if not g[0]}
    assert not unexpected_urls, f"{account} was granted non-resource URLs: {unexpected_urls}"
    return extra


def documented_operator_rules() -> list[dict[str, Any]]:
    """The rules of the Role in the RBAC section of docs/operator.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    roles = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "Role"]
    assert len(roles) == 1, "docs/operator.md should document exactly one Role"
    rules: list[dict[str, Any]] = roles[0]["rules"]
    return rules


def expand(rules: list[dict[str, Any]], rename: dict[str, str]) -> set[Grant]:
    """Rules as `can-i --list` shows them: `roletables.rolegate.dev/status`, `configmaps`."""
    found: set[Grant] = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                base, _, sub = resource.partition("/")
                shown = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
                for name in rule.get("resourceNames") or [""]:
                    for verb in rule["verbs"]:
                        found.add((shown, rename.get(name, name), verb))
    return found


# --- fixtures ------------------------------------------------------------------------------

KEY_SECRET = "router-key"


@pytest.fixture(scope="module")
def release(crds: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The chart installed as release `edge` (fullname `edge-rolegate`) into a namespace of
    its own, watching that namespace and a second one, with an API-key Secret mounted."""
    home = fresh_namespace(crds, "home")
    second = fresh_namespace(crds, "second")
    crds.kubectl(
        "-n", home, "create", "secret", "generic", KEY_SECRET, "--from-literal=apiKey=sk-test",
    )  # fmt: skip
    values = {
        "watchNamespaces": [home, second],
        "operator": {"logLevel": "info"},
        "proxy": {
            "apiKeySecrets": [KEY_SECRET], "logLevel": "info", "statusHeartbeatSeconds": 2,
            "memoryPublishSeconds": 1,
        },
    }  # fmt: skip
    return install_release(crds, "edge", home, values, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def elsewhere(release: Release) -> str:
    """A namespace the release does not watch."""
    return fresh_namespace(release.plane, "elsewhere")


@dataclass
class Stack:
    """The operator and the proxy running as the chart's accounts, beside a simulator."""

    release: Release
    sim_url: str
    operator: Process
    proxy: Process
    proxy_url: str
    # The proxy's `--metrics-port` listener: /metrics, and the probes' /healthz and /readyz.
    metrics_url: str
    proxy_pod: str
    operator_kubeconfig: Path
    proxy_kubeconfig: Path

    def assert_never_forbidden(self) -> None:
        for name, process in (("operator", self.operator), ("proxy", self.proxy)):
            refused = [line for line in process.log().splitlines() if FORBIDDEN.search(line)]
            assert not refused, f"the {name} was refused:\n" + "\n".join(refused[:20])

    def wait(self, probe: Callable[[], T | None], what: str) -> T:
        """`wait_for` while both processes live, failing at once on a refusal in a log."""

        def checked() -> T | None:
            self.assert_never_forbidden()
            return probe()

        return wait_for(checked, what, alive=[self.operator, self.proxy])


def start_components(
    release: Release, sim_url: str, directory: Path, started: list[Process]
) -> Stack:
    """The operator and the proxy as local processes, each with the arguments and
    environment its Deployment gives it, authenticated as its own ServiceAccount (each is
    added to `started` as soon as it runs); returns once the proxy is ready."""
    home = release.namespace
    operator_kubeconfig = release.token_kubeconfig(
        release.operator_account, directory / "operator.kubeconfig"
    )
    proxy_kubeconfig = release.token_kubeconfig(
        release.proxy_account, directory / "proxy.kubeconfig"
    )
    operator_pod = chart_pod(release, "operator")
    args, env = chart_command(
        operator_pod, directory / "operator-root", operator_kubeconfig,
        {"--liveness-port": str(free_port()), "--metrics-port": str(free_port())},
    )  # fmt: skip
    assert flag_values(args, "--lease-name") == [release.lease]
    assert env["POD_NAME"] == operator_pod.name
    assert flag_values(args, "--namespace") == list(release.watched)
    assert flag_values(args, "--configmap") == [release.configmap]
    assert flag_values(args, "--configmap-namespace") == [home]
    operator = Process(args, directory / "operator.log", process_env(**env))
    started.append(operator)
    proxy_pod = chart_pod(release, "proxy")
    root = directory / "proxy-root"
    kubelet_mounts(release, proxy_pod, root)
    port, metrics_port = free_port(), free_port()
    args, env = chart_command(
        proxy_pod, root, proxy_kubeconfig,
        {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(metrics_port)},
    )  # fmt: skip
    assert flag_values(args, "--configmap") == [f"{home}/{release.configmap}"]
    assert "--metrics-host" not in args, "the metrics port listens where the API does"
    proxy = Process(args, directory / "proxy.log", process_env(**env))
    started.append(proxy)
    proxy_url = f"http://127.0.0.1:{port}"
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    # Where the chart's readiness probe asks.
    probe = proxy_pod.container["readinessProbe"]["httpGet"]
    assert probe["port"] == "metrics"
    wait_for(
        lambda: answers(f"{metrics_url}{probe['path']}"),
        "the proxy to serve the operator's ConfigMap",
        within=40,
        alive=started,
    )
    return Stack(
        release, sim_url, operator, proxy, proxy_url, metrics_url, proxy_pod.name,
        operator_kubeconfig, proxy_kubeconfig,
    )  # fmt: skip


def stop_all(started: list[Process]) -> None:
    for process in reversed(started):
        process.stop()
    for process in started:  # shown only when a test fails
        print(f"--- rolegate {' '.join(process.args[:3])} ---\n{process.log()[-8000:]}")


@pytest.fixture(scope="module")
def stack(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The simulator, the operator and the proxy, the last two as the chart runs them. A
    ProviderPolicy in each watched namespace (each serving its own model) and a RoleTable
    with a role on each."""
    directory = tmp_path_factory.mktemp("stack")
    home, second = release.watched
    started: list[Process] = []
    try:
        sim, sim_url = start_sim([MODEL_HOME, MODEL_SECOND], directory)
        started.append(sim)
        url = f"{sim_url}/v1"
        # A long cooldown: the trip stays on the status while the test reads it.
        breaker = {"cooldownSeconds": 30}
        objects = [
            # Provider names are one namespace across the watched namespaces.
            (home, provider_policy("nearby", url, {MODEL_HOME: ["m1"]})),
            (second, provider_policy("router", url, {MODEL_SECOND: ["m1"]}, breaker=breaker)),
            (home, role_table(role("helper", [MODEL_HOME]), role("agent", [MODEL_SECOND]))),
            (home, open_access()),
        ]
        for namespace, manifest in objects:
            manifest["metadata"]["namespace"] = namespace
            release.apply(manifest)
        yield start_components(release, sim_url, directory, started)
    finally:
        stop_all(started)


# --- 1. the objects ------------------------------------------------------------------------


def test_the_chart_creates_namespaced_rbac_only_with_the_contracts_names(
    release: Release,
) -> None:
    manifest = release.helm("get", "manifest", release.name)
    docs = [doc for doc in yaml.safe_load_all(manifest) if doc]
    cluster_roles = [doc for doc in docs if doc["kind"] == "ClusterRole"]
    # The one cluster-scoped right: the proxy may create TokenReviews (docs/access.md).
    assert [rule for doc in cluster_roles for rule in doc["rules"]] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    for account in (release.proxy_account, release.operator_account):
        release.kubectl("get", "serviceaccount", account)
        for namespace in release.watched:
            release.kubectl("get", "role", account, namespace=namespace)
            binding = release.json("get", "rolebinding", account, namespace=namespace)
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account,
            }  # fmt: skip
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": release.namespace}
            ]


# --- 2. impersonation: the proxy -----------------------------------------------------------

CLUSTER_WIDE: list[list[str]] = [
    ["list", "namespaces"],
    ["list", "nodes"],
    ["list", "customresourcedefinitions.apiextensions.k8s.io"],
    ["list", "clusterroles.rbac.authorization.k8s.io"],
    ["create", "clusterrolebindings.rbac.authorization.k8s.io"],
    ["get", "secrets", "--all-namespaces"],
    ["list", "providerpolicies.rolegate.dev", "--all-namespaces"],
]
ESCALATION: list[list[str]] = [
    ["create", "pods", "--subresource=exec"],
    ["create", "pods"],
    ["impersonate", "serviceaccounts"],
    ["impersonate", "users"],
    ["impersonate", "groups"],
    ["create", "roles.rbac.authorization.k8s.io"],
    ["create", "rolebindings.rbac.authorization.k8s.io"],
    ["create", "serviceaccounts", "--subresource=token"],
]


MEMORIES = "proxymemories.rolegate.dev"
MEMORY_VERBS = ("get", "list", "watch", "create", "patch", "delete")


def proxy_answers(
    release: Release, elsewhere: str
) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    home = release.namespace
    configmap = f"configmaps/{release.configmap}"
    yes = [(home, [verb, configmap]) for verb in ("get", "list", "watch")] + [
        (ns, ["patch", "providerpolicies.rolegate.dev", "--subresource=status"])
        for ns in release.watched
    ]
    # Verifying callers' ServiceAccount tokens: cluster-scoped, and nothing else about
    # authentication (docs/access.md).
    yes += [(home, ["create", "tokenreviews.authentication.k8s.io"])]
    # The fleet's memory, in the release namespace only: its own written and read back,
    # the others' listed and watched, a day-old one deleted.
    yes += [(home, [verb, MEMORIES]) for verb in MEMORY_VERBS]
    no: list[tuple[str, list[str]]] = [
        (home, ["update", MEMORIES]),
        (home, ["deletecollection", MEMORIES]),
        (home, ["patch", MEMORIES, "--subresource=status"]),
    ]
    no += [(ns, [verb, MEMORIES]) for ns in release.watched[1:] for verb in MEMORY_VERBS]
    no += [(elsewhere, [verb, MEMORIES]) for verb in MEMORY_VERBS]
    no += [(home, ["list", MEMORIES, "--all-namespaces"])]
    for ns in release.watched:
        no += [(ns, [verb, "providerpolicies.rolegate.dev"]) for verb in (
            "get", "list", "watch", "patch", "update", "create", "delete")]  # fmt: skip
        no += [
            (ns, ["update", "providerpolicies.rolegate.dev", "--subresource=status"]),
            (ns, ["patch", "roletables.rolegate.dev", "--subresource=status"]),
            (ns, ["list", "roletables.rolegate.dev"]),
            (ns, ["get", "secrets"]),
            (ns, ["list", "secrets"]),
            (ns, ["watch", "secrets"]),
            (ns, ["get", f"secrets/{KEY_SECRET}"]),  # the one mounted into it
            (ns, ["get", "configmaps/some-other-config"]),
            (ns, ["list", "configmaps"]),
            (ns, ["watch", "configmaps"]),
            (ns, ["create", "configmaps"]),
            (ns, ["create", "events"]),
            *((ns, question) for question in ESCALATION),
        ]
    no += [
        (home, [verb, configmap]) for verb in ("update", "patch", "delete")
    ]  # its own ConfigMap: read only
    # Its ConfigMap's name means nothing outside the release namespace.
    no += [(ns, ["get", configmap]) for ns in release.watched[1:]]
    no += [
        (elsewhere, ["patch", "providerpolicies.rolegate.dev", "--subresource=status"]),
        (elsewhere, ["get", configmap]),
        (elsewhere, ["list", "secrets"]),
        (elsewhere, ["list", "configmaps"]),
    ]
    no += [(home, question) for question in CLUSTER_WIDE]
    return yes, no


def test_the_proxy_account_can_exactly_what_it_needs(release: Release, elsewhere: str) -> None:
    yes, no = proxy_answers(release, elsewhere)
    check_answers(release, release.proxy_account, yes, no)


def test_the_proxy_account_is_granted_nothing_unexpected(release: Release, elsewhere: str) -> None:
    status = ("providerpolicies.rolegate.dev/status", "", "patch")
    config = {("configmaps", release.configmap, verb) for verb in ("get", "list", "watch")}
    memories = {(MEMORIES, "", verb) for verb in MEMORY_VERBS}
    expected = {release.namespace: {status, *config, *memories}}
    expected |= {ns: {status} for ns in release.watched[1:]}
    expected[elsewhere] = set()
    # The cluster-scoped right to create TokenReviews shows in every namespace's list.
    review = ("tokenreviews.authentication.k8s.io", "", "create")
    for namespace, wanted in expected.items():
        found = grants(release, release.proxy_account, namespace)
        assert found == wanted | {review}, namespace


# --- 2. impersonation: the operator --------------------------------------------------------


def operator_answers(
    release: Release, elsewhere: str
) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    home = release.namespace
    configmap = f"configmaps/{release.configmap}"
    leases = "leases.coordination.k8s.io"
    lease = f"{leases}/{release.lease}"
    kinds = ("roletables.rolegate.dev", "providerpolicies.rolegate.dev")
    yes: list[tuple[str, list[str]]] = []
    no: list[tuple[str, list[str]]] = []
    for ns in release.watched:
        yes += [(ns, [verb, kind]) for kind in kinds for verb in ("list", "watch")]
        yes += [(ns, ["patch", kind, "--subresource=status"]) for kind in kinds]
        # A repeated Event is patched to count up.
        yes += [(ns, ["create", "events"]), (ns, ["patch", "events"])]
        # list and watch only: not even `get` (kopf and the start-up check list).
        no += [(ns, [verb, kind]) for kind in kinds for verb in (
            "get", "patch", "update", "create", "delete", "deletecollection")]  # fmt: skip
        no += [(ns, ["update", kind, "--subresource=status"]) for kind in kinds]
        no += [
            (ns, ["get", "secrets"]),
            (ns, ["list", "secrets"]),
            (ns, ["get", f"secrets/{KEY_SECRET}"]),
            (ns, ["get", "configmaps/some-other-config"]),
            (ns, ["update", "configmaps/some-other-config"]),
            (ns, ["list", "configmaps"]),
            (ns, ["delete", "events"]),
            (ns, ["update", "events"]),
            *((ns, question) for question in ESCALATION),
        ]
    yes += [
        (home, ["create", "configmaps"]),
        (home, ["get", configmap]),
        (home, ["update", configmap]),
    ]
    no += [(home, [verb, configmap]) for verb in ("delete", "patch")]
    # Leader election: create a Lease (not limitable by name), then read and write its
    # own Lease only. Never delete, list, watch or patch one, nor touch another's.
    yes += [(home, ["create", leases]), (home, ["get", lease]), (home, ["update", lease])]
    no += [(home, [verb, lease]) for verb in ("delete", "patch", "watch")]
    no += [(home, [verb, leases]) for verb in ("list", "watch", "deletecollection")]
    no += [
        (home, [verb, f"{leases}/{other}"])
        for other in ("kube-controller-manager", "rolegate-operator", f"{release.fullname}-proxy")
        for verb in ("get", "update")
    ]
    # The ConfigMap and Lease rules hold only where the ConfigMap and the Lease live.
    no += [(ns, ["create", "configmaps"]) for ns in release.watched[1:]]
    no += [(ns, ["get", configmap]) for ns in release.watched[1:]]
    no += [(ns, ["create", leases]) for ns in release.watched[1:]]
    no += [(ns, [verb, lease]) for ns in release.watched[1:] for verb in ("get", "update")]
    no += [
        (elsewhere, ["list", "roletables.rolegate.dev"]),
        (elsewhere, ["patch", "providerpolicies.rolegate.dev", "--subresource=status"]),
        (elsewhere, ["create", "events"]),
        (elsewhere, ["patch", "events"]),
        (elsewhere, ["create", "configmaps"]),
        (elsewhere, ["get", configmap]),
        (elsewhere, ["create", leases]),
        (elsewhere, ["get", lease]),
        (elsewhere, ["update", lease]),
    ]
    no += [(home, question) for question in CLUSTER_WIDE]
    no += [(home, ["list", "roletables.rolegate.dev", "--all-namespaces"])]
    return yes, no


def test_the_operator_account_can_exactly_what_it_needs(release: Release, elsewhere: str) -> None:
    yes, no = operator_answers(release, elsewhere)
    check_answers(release, release.operator_account, yes, no)


def test_the_operator_account_holds_exactly_the_documented_role(
    release: Release, elsewhere: str
) -> None:
    """docs/operator.md's Role (its ConfigMap and Lease renamed to the release's) in the
    release namespace; its rolegate.dev and events rules in the other watched namespace."""
    rename = {"rolegate-config": release.configmap, "rolegate-operator": release.lease}
    documented = expand(documented_operator_rules(), rename)
    assert documented, "the documented Role has no rules"
    assert ("leases.coordination.k8s.io", release.lease, "update") in documented
    watching = {g for g in documented if g[0] not in ("configmaps", "leases.coordination.k8s.io")}
    expected = {release.namespace: documented}
    expected |= {ns: watching for ns in release.watched[1:]}
    expected[elsewhere] = set()
    for namespace, wanted in expected.items():
        assert grants(release, release.operator_account, namespace) == wanted, namespace


def test_the_operator_token_holds_its_own_lease_and_no_other(
    crds: ControlPlane, tmp_path: Path
) -> None:
    """What `can-i` says about Leases, done for real with a TokenRequest token of the
    operator's account, on a release of its own (no operator runs there, so the Lease is
    the test's to write): it creates, reads and renews its Lease; it cannot delete or list
    Leases, nor read or write another Lease, nor create one outside its namespace."""
    home = fresh_namespace(crds, "lease")
    second = fresh_namespace(crds, "lease-second")
    release = install_release(crds, "lease", home, {"watchNamespaces": [home, second]}, tmp_path)
    token = release.token_kubeconfig(release.operator_account, tmp_path / "operator.kubeconfig")

    def lease(name: str, holder: str, namespace: str = home) -> Path:
        path = tmp_path / f"{namespace}-{name}-{holder}.json"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15},
                }
            )
        )
        return path

    def allowed(*args: str, namespace: str = home) -> str:
        result = release.as_token(token, *args, namespace=namespace)
        assert result.returncode == 0, f"{args}: {result.stderr}"
        return result.stdout

    def refused(*args: str, namespace: str = home) -> None:
        result = release.as_token(token, *args, namespace=namespace)
        assert result.returncode != 0, f"{args} was allowed: {result.stdout}"
        assert "Forbidden" in result.stderr, result.stderr
        assert release.subject(release.operator_account) in result.stderr

    own = release.lease
    allowed("create", "-f", str(lease(own, "pod-a_1")))
    held = json.loads(allowed("get", "lease", own, "-o", "json"))
    assert held["spec"]["holderIdentity"] == "pod-a_1"
    allowed("replace", "-f", str(lease(own, "pod-b_2")))  # an update: a takeover
    assert release.json("get", "lease", own)["spec"]["holderIdentity"] == "pod-b_2"
    refused("delete", "lease", own)
    refused("patch", "lease", own, "--type=merge", "-p", '{"spec":{"holderIdentity":"x"}}')
    refused("get", "leases")  # a list
    # Another Lease: `create` cannot be limited by name, but past that it is not its own.
    other = "kube-scheduler"
    crds.kubectl("-n", home, "create", "-f", str(lease(other, "someone")))
    refused("get", "lease", other)
    refused("replace", "-f", str(lease(other, "pod-a_1")))
    assert release.json("get", "lease", other)["spec"]["holderIdentity"] == "someone"
    # The Lease rules hold only in the release namespace.
    refused("create", "-f", str(lease(own, "pod-a_1", second)), namespace=second)
    assert release.json("get", "lease", own)["spec"]["holderIdentity"] == "pod-b_2"


# --- 3. the processes do their job as the chart's accounts ----------------------------------


def test_the_operator_compiles_and_writes_status_as_its_account(stack: Stack) -> None:
    release = stack.release
    home, second = release.watched
    expected = [(home, "rt", "roles"), (home, "pp", "nearby"), (second, "pp", "router")]
    for namespace, resource, name in expected:

        def shows_accepted(ns: str = namespace, kind: str = resource, name: str = name) -> bool:
            return accepted(release.json("get", kind, name, namespace=ns))

        stack.wait(shows_accepted, f"{resource} {namespace}/{name} Accepted")
    compiled = json.loads(
        release.json("get", "configmap", release.configmap)["data"]["config.json"]
    )
    assert {p["source"] for p in compiled["providers"]} == {f"{home}/nearby", f"{second}/router"}
    assert {r["name"] for r in compiled["roles"]} == {"helper", "agent"}
    stack.assert_never_forbidden()


def test_a_rejected_edit_becomes_a_warning_event_in_a_watched_namespace(stack: Stack) -> None:
    release = stack.release
    second = release.watched[1]
    table = role_table(role("side", [MODEL_SECOND]), name="side")
    table["metadata"]["namespace"] = second
    release.plane.kubectl("apply", "-f", "-", input=json.dumps(table))
    stack.wait(
        lambda: accepted(release.json("get", "rt", "side", namespace=second)),
        "the side RoleTable Accepted",
    )
    table["spec"]["roles"] = [role("side", ["vendor/no-such-model"])]
    release.plane.kubectl("apply", "-f", "-", input=json.dumps(table))
    stack.wait(
        lambda: accepted(release.json("get", "rt", "side", namespace=second), "False"),
        "the edit rejected (Accepted=False)",
    )

    def warning() -> list[dict[str, Any]]:
        events = release.json(
            "get", "events", "--field-selector", "involvedObject.name=side", namespace=second
        )["items"]
        return [e for e in events if e["type"] == "Warning" and e["reason"] == "NoServedModel"]

    stack.wait(warning, "the Warning Event")
    stack.assert_never_forbidden()


def test_the_proxy_reports_a_trip_on_the_policy_in_each_watched_namespace(
    stack: Stack,
) -> None:
    release = stack.release
    home, second = release.watched

    def report(namespace: str) -> dict[str, Any] | None:
        name = "nearby" if namespace == home else "router"
        status = release.json("get", "pp", name, namespace=namespace).get("status") or {}
        reports = [r for r in status.get("reports") or () if r["pod"] == stack.proxy_pod]
        return reports[0] if reports else None

    # Heartbeats reach both namespaces' policies.
    stack.wait(lambda: report(home), "the proxy's report in the home namespace")
    stack.wait(lambda: report(second), "the proxy's report in the second")

    set_faults(stack.sim_url, MODEL_SECOND, [{"kind": "empty", "always": True}])
    try:
        for _ in range(3):
            httpx.post(
                f"{stack.proxy_url}/v1/chat/completions",
                json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )

        def tripped() -> dict[str, Any] | None:
            found = report(second)
            breakers = (found or {}).get("breakers") or []
            return found if any(b["reason"] == "EmptyResponses" for b in breakers) else None

        shown = stack.wait(tripped, "the trip on the second namespace's policy")
        assert shown["breakers"][0]["model"] == MODEL_SECOND

        def condition() -> bool:
            status = release.json("get", "pp", "router", namespace=second).get("status") or {}
            return any(
                c["type"] == "Tripped" and c["status"] == "True"
                for c in status.get("conditions") or ()
            )

        # The operator summarises the reports into a condition (its status write).
        stack.wait(condition, "Tripped=True from the operator")
        assert not (report(home) or {}).get("breakers"), "the home policy was not at fault"
    finally:
        set_faults(stack.sim_url, MODEL_SECOND, [])
    stack.assert_never_forbidden()


def test_the_proxy_shares_its_memory_and_deletes_a_day_old_one_as_its_account(
    stack: Stack,
) -> None:
    release = stack.release
    home, second = release.watched
    own = f"memory-{stack.proxy_pod}"

    def memories(namespace: str = home) -> dict[str, dict[str, Any]]:
        found = release.json("get", "pmem", namespace=namespace)["items"]
        return {item["metadata"]["name"]: item for item in found}

    # Written by server-side apply (created the first time, then patched), every second.
    first = stack.wait(lambda: memories().get(own), "the proxy's ProxyMemory")
    assert first["spec"]["pod"] == stack.proxy_pod
    assert first["metadata"]["labels"] == {"app.kubernetes.io/component": "proxy-memory"}
    shown = release.json("get", "pmem", own, "--show-managed-fields")
    managers = {entry["manager"] for entry in shown["metadata"]["managedFields"]}
    assert managers == {f"rolegate-proxy/{stack.proxy_pod}"}

    def rewritten() -> bool:
        again = memories().get(own)
        return again is not None and datetime.fromisoformat(
            again["spec"]["writtenAt"]
        ) > datetime.fromisoformat(first["spec"]["writtenAt"])

    stack.wait(rewritten, "the ProxyMemory written again")
    # A gone pod's memory of two days ago: heard by nobody, deleted by the proxy.
    written = time.time() - 2 * 86_400
    memory = json.dumps({"format": 1, "pod": "gone-pod", "writtenAt": written, "machines": []})
    release.apply({
        "apiVersion": "rolegate.dev/v1alpha1", "kind": "ProxyMemory",
        "metadata": {"name": "memory-gone-pod", "namespace": home,
                     "labels": {"app.kubernetes.io/component": "proxy-memory"}},
        "spec": {"pod": "gone-pod", "machines": 0, "memory": memory,
                 "writtenAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(written))},
    })  # fmt: skip
    stack.wait(lambda: "memory-gone-pod" not in memories(), "the day-old memory deleted")
    # Only in the release namespace, the ConfigMap's.
    assert memories(second) == {}
    stack.assert_never_forbidden()


def test_the_same_tokens_are_refused_what_the_chart_does_not_grant(stack: Stack) -> None:
    release = stack.release
    second = release.watched[1]
    proxy, operator = stack.proxy_kubeconfig, stack.operator_kubeconfig
    # The tokens are good: what the chart grants works with them.
    for kubeconfig in (proxy, operator):
        assert release.as_token(kubeconfig, "get", "configmap", release.configmap).returncode == 0
    for kubeconfig, name in ((proxy, "proxy"), (operator, "operator")):
        refused = release.as_token(kubeconfig, "get", "secrets")
        assert refused.returncode != 0
        assert "Forbidden" in refused.stderr, refused.stderr
        assert release.subject(f"{release.fullname}-{name}") in refused.stderr
    spec_edit = release.as_token(
        proxy, "patch", "pp", "router", "--type", "merge",
        "-p", json.dumps({"spec": {"endpoint": "http://attacker.invalid/v1"}}),
        namespace=second,
    )  # fmt: skip
    assert spec_edit.returncode != 0
    assert "Forbidden" in spec_edit.stderr, spec_edit.stderr
    assert "attacker" not in release.kubectl("get", "pp", "router", "-o", "yaml", namespace=second)
