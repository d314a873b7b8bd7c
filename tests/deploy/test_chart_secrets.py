"""The canary (SPEC C8, E1) extended to the Helm chart: an API key reaches the proxy only
through the Secret the chart mounts, never through the ConfigMap, a custom resource, the
rendered manifests, Helm's stored values, an environment variable or a log line.

The release is named `rolegate` (so its fullname is `rolegate` itself, the other naming
rule from test_chart_rbac.py's `edge-rolegate`) and installed with
`proxy.apiKeySecrets=[<name>]` and an admin-token Secret; the ProviderPolicy names the key
as `apiKeySecretRef: {name: <name>, key: apiKey}`. The operator and the proxy run as local
processes, with the arguments their Deployments give them and TokenRequest tokens of the
chart's ServiceAccounts (no kubelet here, so Pods never run).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from rolegate_cli.controlplane import ControlPlane

from ..support import access_grant, provider_policy, role, role_table
from .conftest import SECRETS_DIR
from .test_chart_rbac import (
    Process,
    Release,
    Stack,
    chart_pod,
    flag_values,
    fresh_namespace,
    install_release,
    set_faults,
    start_components,
    start_sim,
    stop_all,
)

MODEL = "vendor/model-canary"
KEY_SECRET = "canary-router-key"
KEY_CANARY = "sk-canary-chart-4e7b1d90"
ADMIN_SECRET = "canary-admin"
ADMIN_CANARY = "admin-canary-chart-93af"
# A caller outside the cluster: its API key lives in a Secret, named by an AccessGrant.
CALLER_SECRET = "canary-caller-key"
CALLER_CANARY = "sk-caller-canary-chart-61c2"
CANARIES = (KEY_CANARY, ADMIN_CANARY, CALLER_CANARY)
PROMPT: Any = [{"role": "user", "content": "plain prompt"}]


@pytest.fixture(scope="module")
def release(crds: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The chart as release `rolegate` in a fresh namespace (watching only it, the
    default), with the key's Secret and the admin token's Secret created first, as a user
    would: `kubectl create secret generic ...` and then `helm install`."""
    namespace = fresh_namespace(crds, "canary")
    secrets = {
        KEY_SECRET: f"apiKey={KEY_CANARY}",
        ADMIN_SECRET: f"token={ADMIN_CANARY}",
        CALLER_SECRET: f"key={CALLER_CANARY}",
    }
    for name, literal in secrets.items():
        crds.kubectl(
            "-n", namespace, "create", "secret", "generic", name, f"--from-literal={literal}"
        )
    values = {
        "operator": {"logLevel": "debug"},
        "proxy": {
            "apiKeySecrets": [KEY_SECRET, CALLER_SECRET],
            "adminTokenSecret": {"name": ADMIN_SECRET, "key": "token"},
            "logLevel": "debug",
            "statusHeartbeatSeconds": 2,
        },
    }
    installed = install_release(crds, "rolegate", namespace, values, tmp_path_factory.mktemp("h"))
    assert installed.fullname == "rolegate"
    assert installed.watched == (namespace,)
    return installed


@pytest.fixture
def stack(release: Release, tmp_path: Path) -> Iterator[Stack]:
    """The simulator, a ProviderPolicy that names the key's Secret, a RoleTable, an
    AccessGrant for the caller's key, and the operator and the proxy as the chart runs
    them."""
    started: list[Process] = []
    try:
        sim, sim_url = start_sim([MODEL], tmp_path)
        started.append(sim)
        policy = provider_policy(
            "canary-router", f"{sim_url}/v1", {MODEL: ["m1"]},
            apiKeySecretRef={"name": KEY_SECRET, "key": "apiKey"},
        )  # fmt: skip
        callers = access_grant(
            "callers", [{"apiKeySecretRef": {"name": CALLER_SECRET, "key": "key"}}], ["agent"]
        )
        for manifest in (policy, role_table(role("agent", [MODEL])), callers):
            manifest["metadata"]["namespace"] = release.namespace
            release.apply(manifest)
        yield start_components(release, sim_url, tmp_path, started)
    finally:
        stop_all(started)


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload among `docs`."""
    found = []
    for doc in docs:
        template = (doc.get("spec") or {}).get("template") or {}
        if "spec" in template:
            found.append((f"{doc['kind']}/{doc['metadata']['name']}", template["spec"]))
    return found


def secret_env(pod_spec: dict[str, Any]) -> list[Any]:
    """Every env var or envFrom of any container that draws on a Secret."""
    containers = [*pod_spec.get("containers", ()), *pod_spec.get("initContainers", ())]
    return [
        *(
            var
            for container in containers
            for var in container.get("env") or ()
            if "secretKeyRef" in (var.get("valueFrom") or {})
        ),
        *(
            source
            for container in containers
            for source in container.get("envFrom") or ()
            if "secretRef" in source
        ),
    ]


def test_the_proxy_deployment_mounts_the_key_read_only_and_no_env_names_a_secret(
    release: Release,
) -> None:
    manifest = [
        doc for doc in yaml.safe_load_all(release.helm("get", "manifest", "rolegate")) if doc
    ]
    assert "Secret" not in {doc["kind"] for doc in manifest}, "the chart must not hold keys"
    installed = release.json("get", "deployment", f"{release.fullname}-proxy")
    workloads = [
        *pod_templates(manifest),
        ("installed proxy", installed["spec"]["template"]["spec"]),
    ]
    names = {name for name, _ in workloads}
    assert {f"Deployment/{release.fullname}-{c}" for c in ("proxy", "operator")} <= names
    for name, pod_spec in workloads:
        assert not secret_env(pod_spec), f"{name} takes a Secret through its environment"

    pod = chart_pod(release, "proxy")
    volumes = [
        v for v in pod.spec["volumes"] if (v.get("secret") or {}).get("secretName") == KEY_SECRET
    ]
    assert len(volumes) == 1, pod.spec["volumes"]
    mounts = [m for m in pod.container["volumeMounts"] if m["name"] == volumes[0]["name"]]
    assert mounts == [
        {"name": volumes[0]["name"], "mountPath": f"{SECRETS_DIR}/{KEY_SECRET}", "readOnly": True}
    ]
    assert flag_values(pod.container["args"], "--secrets-dir") == [SECRETS_DIR]


@dataclass
class Surfaces:
    texts: dict[str, str]

    def add(self, name: str, text: str) -> None:
        assert text.strip(), f"the {name} surface is empty: searching it proves nothing"
        self.texts[name] = text


def read_api_objects(release: Release, surfaces: Surfaces) -> None:
    """Every object of the release namespace a key could hide in, as `kubectl get -o yaml`
    shows it (status included), and what Helm stores of the release."""
    surfaces.add("ConfigMaps", release.kubectl("get", "configmaps", "-o", "yaml"))
    for kind in ("roletables", "providerpolicies", "deployments", "events"):
        surfaces.add(kind, release.kubectl("get", kind, "-o", "yaml"))
    surfaces.add("helm get manifest", release.helm("get", "manifest", release.name))
    surfaces.add("helm get values --all", release.helm("get", "values", release.name, "--all"))


def test_the_key_reaches_the_provider_through_the_mount_and_leaks_nowhere(stack: Stack) -> None:
    """The proxy's key arrives the way the kubelet gives it: `start_components` writes the
    Secret's data (read with the admin's kubectl, base64-decoded) to
    `<pod root>/var/run/secrets/rolegate/<name>/apiKey` and the proxy runs with
    `--secrets-dir <pod root>/var/run/secrets/rolegate`, which is exactly the
    mounted-volume layout (`<secrets dir>/<secret name>/<key>`); the admin token likewise.
    Nothing reaches it through its environment."""
    release = stack.release
    secrets_dir = Path(flag_values(stack.proxy.args, "--secrets-dir")[0])
    assert (secrets_dir / KEY_SECRET / "apiKey").read_text() == KEY_CANARY
    environ = {
        name: process.environ()
        for name, process in (("proxy", stack.proxy), ("operator", stack.operator))
    }
    leaked_vars = [v for env in environ.values() for v in env if v.startswith("ROLEGATE_SECRET_")]
    assert not leaked_vars

    # The caller's key arrived through its mounted Secret: it admits, nothing else does.
    with openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key="x", max_retries=0) as ai:
        with pytest.raises(openai.AuthenticationError) as refused:
            ai.chat.completions.create(model="agent", messages=PROMPT)
        assert refused.value.code == "invalid_api_key"
    caller = {"Authorization": f"Bearer {CALLER_CANARY}"}
    # Traffic: a plain answer, a streamed one, and an upstream failure (an error path).
    with openai.OpenAI(
        base_url=f"{stack.proxy_url}/v1", api_key=CALLER_CANARY, max_retries=0
    ) as ai:
        answer = ai.chat.completions.create(model="agent", messages=PROMPT)
        assert answer.choices[0].message.content
        stream = ai.chat.completions.create(model="agent", messages=PROMPT, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    set_faults(stack.sim_url, MODEL, [{"kind": "serverError", "always": True, "status": 503}])
    failed = httpx.post(
        f"{stack.proxy_url}/v1/chat/completions",
        json={"model": "agent", "messages": PROMPT},
        headers=caller,
        timeout=30,
    )
    assert failed.status_code >= 500
    set_faults(stack.sim_url, MODEL, [])

    # The key did reach the provider, so its absence elsewhere means something.
    records = httpx.get(f"{stack.sim_url}/_sim/requests").json()
    assert len(records) >= 3
    fingerprint = hashlib.sha256(KEY_CANARY.encode()).hexdigest()[:12]
    assert {record["bearer_sha256"] for record in records} == {fingerprint}

    admin = {"Authorization": f"Bearer {ADMIN_CANARY}"}
    surfaces = Surfaces({})
    with httpx.Client(base_url=stack.proxy_url, timeout=10) as client:
        # The admin token arrived through its mounted Secret: the endpoints need it (a
        # caller's key is no admin right).
        assert client.get("/v1/rolegate/decisions").status_code == 401
        assert client.get("/v1/rolegate/decisions", headers=caller).status_code == 403
        decisions = client.get("/v1/rolegate/decisions", headers=admin)
        assert decisions.status_code == 200
        assert '"grant": "' + release.namespace + '/callers"' in decisions.text
        surfaces.add("/v1/rolegate/decisions", decisions.text)
        surfaces.add("/v1/rolegate/state", client.get("/v1/rolegate/state", headers=admin).text)
        # The chart's proxy serves /metrics on its metrics port only.
        assert client.get("/metrics").status_code == 404
        metrics = httpx.get(f"{stack.metrics_url}/metrics", timeout=10)
        assert metrics.status_code == 200
        assert "rolegate_requests_total" in metrics.text
        surfaces.add("/metrics", metrics.text)
        surfaces.add("/v1/models", client.get("/v1/models").text)
        surfaces.add("/readyz", client.get("/readyz").text)
    read_api_objects(release, surfaces)
    for name, env in environ.items():
        surfaces.add(f"the {name}'s environment", "\n".join(f"{k}={v}" for k, v in env.items()))
    for name, process in (("proxy", stack.proxy), ("operator", stack.operator)):
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode().replace("\0", " ")
        surfaces.add(f"the {name}'s command line", cmdline)
    for process in (stack.proxy, stack.operator):
        process.stop()  # flushes everything they would log
    for name, process in (("proxy", stack.proxy), ("operator", stack.operator)):
        # Their most verbose: the chart passes the values' logLevel through.
        assert flag_values(process.args, "--log-level") == ["debug"], process.args
        surfaces.add(f"the {name}'s log", process.log())
    # The searches look where the key would be: the compiled configuration, the Secret's
    # name where it is referenced, the proxy's real environment.
    assert "sha256:" in surfaces.texts["ConfigMaps"]
    for surface in ("providerpolicies", "helm get values --all", "helm get manifest"):
        assert KEY_SECRET in surfaces.texts[surface], surface
    assert f"POD_NAME={stack.proxy_pod}" in surfaces.texts["the proxy's environment"]

    leaks = [
        f"{canary} in {surface}"
        for surface, text in surfaces.texts.items()
        for canary in CANARIES
        if canary in text
    ]
    assert not leaks, leaks
    stack.assert_never_forbidden()
