"""Reaching the Kubernetes API from the proxy: credentials from a kubeconfig or the pod.

The proxy talks to the API server with its own aiohttp session (it needs one watch, not a
client library's thread pool). Credentials are loaded by the official `kubernetes`
package's loaders, re-read on every (re)connect so rotated service-account tokens and
refreshed kubeconfig credentials are picked up. Loading reads files, so callers run it
in a worker thread, never on the request path.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KubeAccess:
    base_url: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool


def in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ


def load_access(kubeconfig: Path | None) -> KubeAccess:
    """Credentials from `kubeconfig`, else in-cluster when in a pod, else the default
    kubeconfig (`$KUBECONFIG` or `~/.kube/config`). Blocking: call via a thread."""
    from kubernetes import client, config

    configuration = client.Configuration()
    # The kubernetes package ships no type hints; these two loaders return None.
    if kubeconfig is None and in_cluster():
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig) if kubeconfig else None,
            client_configuration=configuration,
        )
    headers = {"Accept": "application/json"}
    # auth_settings() renders whatever the loader found (token, refreshed exec-plugin
    # credentials, basic auth) as the header it belongs in.
    settings: dict[str, Any] = dict(configuration.auth_settings())
    for setting in settings.values():
        if setting.get("in") == "header" and setting.get("value"):
            headers[setting["key"].title()] = setting["value"]
    context: ssl.SSLContext | bool
    if configuration.verify_ssl:
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    else:
        context = False
    if configuration.cert_file and configuration.key_file and isinstance(context, ssl.SSLContext):
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return KubeAccess(base_url=configuration.host.rstrip("/"), headers=headers, ssl_context=context)
