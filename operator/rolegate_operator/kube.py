"""The operator's writes to the API server, through the official `kubernetes` client.

Synchronous calls (the compile loop runs them with `asyncio.to_thread`), each bounded by
a request timeout so a hung API server cannot hold a thread forever:

- status: server-side apply on the `/status` subresource as field manager
  `rolegate-operator`, sending only the fields the operator owns (see `conditions`);
- Events: core/v1 Events about a resource, created and then patched with a growing
  `count` as `recorder.EventRecorder` decides (see `events`), so `kubectl describe` shows
  them;
- the ConfigMap: `data["config.json"]` (the canonical JSON of the compiled
  configuration), annotation `rolegate.dev/config-hash`, label
  `app.kubernetes.io/managed-by: rolegate-operator`; read first and written only when
  the content differs, retrying on a 409 conflict by reading again.

The same loaded credentials feed kopf (`connection_info`), so the watch and the writes
talk to one API server as one identity.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

import kopf
from kubernetes import client, config

from rolegate_operator.conditions import format_time
from rolegate_operator.events import EventKey
from rolegate_operator.leader import LeaseRecord, micro_time
from rolegate_operator.store import API_VERSION, GROUP, KINDS, VERSION, ResourceKey
from rolegate_policy.config import (
    ProxyConfig,
)

FIELD_MANAGER: Final = "rolegate-operator"
CONFIG_KEY: Final = "config.json"
HASH_ANNOTATION: Final = f"{GROUP}/config-hash"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
# (connect, read) seconds for every request the operator makes itself.
REQUEST_TIMEOUT: Final = (5.0, 30.0)
# Lease calls must answer well within the renew deadline (10 s by default).
LEASE_TIMEOUT: Final = (2.0, 4.0)
CONFLICT_RETRIES: Final = 5

log = logging.getLogger("rolegate.operator.kube")


class ConfigMapWrite(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


class ConflictPersisted(RuntimeError):
    """The ConfigMap kept changing under us: every retry met a newer version."""


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """Credentials from `kubeconfig`; without one, in-cluster, else the default kubeconfig."""
    configuration = client.Configuration()
    # The config loaders are not annotated (kubernetes-client/python).
    if kubeconfig is not None:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
        return configuration
    try:
        config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """The loaded credentials in the shape kopf's `@kopf.on.login` handlers return."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    scheme: str | None = None
    token: str | None = None
    if header:
        parts = header.split(" ", 1)
        scheme, token = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


class Kube:
    """The operator's own API calls. Raises `kubernetes.client.ApiException` (and
    connection errors) for the caller to retry, except where noted."""

    def __init__(self, configuration: client.Configuration) -> None:
        self._client = client.ApiClient(configuration)
        self._custom = client.CustomObjectsApi(self._client)
        self._core = client.CoreV1Api(self._client)
        self._coordination = client.CoordinationV1Api(self._client)
        self._instance = socket.gethostname()

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]

    def list_uids(self, kind: str, namespace: str | None) -> set[str] | None:
        """The uids of every object of `kind` (in `namespace`, or everywhere); None when
        the kind is not served (its CRD is not installed)."""
        plural = KINDS[kind].plural
        uids: set[str] = set()
        token: str | None = None
        while True:
            try:
                if namespace is None:
                    page = self._custom.list_cluster_custom_object(
                        GROUP, VERSION, plural, limit=500, _continue=token,
                        _request_timeout=REQUEST_TIMEOUT,
                    )  # fmt: skip
                else:
                    page = self._custom.list_namespaced_custom_object(
                        GROUP, VERSION, namespace, plural, limit=500, _continue=token,
                        _request_timeout=REQUEST_TIMEOUT,
                    )  # fmt: skip
            except client.ApiException as error:
                if error.status == 404:
                    return None
                raise
            body = _mapping(page)
            for item in body.get("items") or []:
                uid = _mapping(_mapping(item).get("metadata")).get("uid")
                if isinstance(uid, str):
                    uids.add(uid)
            token = _mapping(body.get("metadata")).get("continue") or None
            if token is None:
                return uids

    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any], field_manager: str = FIELD_MANAGER
    ) -> dict[str, Any] | None:
        """Server-side apply of `status` (only the fields `field_manager` owns) to the
        resource's `/status`; the object as stored afterwards, or None when it is gone."""
        body = {
            "apiVersion": API_VERSION,
            "kind": key.kind,
            "metadata": {"name": key.name, "namespace": key.namespace},
            "status": dict(status),
        }
        try:
            written = self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, key.namespace, KINDS[key.kind].plural, key.name, body,
                field_manager=field_manager, force=True,
                _content_type="application/apply-patch+yaml",
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise
        return dict(_mapping(written))

    def remove_reports(
        self, key: ResourceKey, reports: Sequence[Mapping[str, Any]], pods: Sequence[str]
    ) -> dict[str, Any] | None:
        """Drop the `status.reports` entries of `pods`, judged expired from `reports` (the
        copy the judgement was made on, possibly stale after an outage). A JSON patch whose
        `test` ops pin each entry to its pod **and its `observedAt`**: if the pod has
        reported again since (or the list moved), the patch fails as a whole and nothing is
        removed; the watch then delivers the fresh report. Returns the object as stored
        after the removal, or None when nothing was removed."""
        operations: list[dict[str, Any]] = []
        # Highest index first, so earlier removals do not shift later ones.
        for index in sorted(
            (i for i, report in enumerate(reports) if report.get("pod") in pods), reverse=True
        ):
            path = f"/status/reports/{index}"
            for name in ("pod", "observedAt"):
                operations.append(
                    {"op": "test", "path": f"{path}/{name}", "value": reports[index].get(name)}
                )
            operations.append({"op": "remove", "path": path})
        if not operations:
            return None
        try:
            written = self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, key.namespace, KINDS[key.kind].plural, key.name, operations,
                _content_type="application/json-patch+json",
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except client.ApiException as error:
            if error.status in (404, 409, 422):  # gone, or a report changed: keep them all
                return None
            raise
        return dict(_mapping(written))

    def check_reachable(self) -> None:
        """Raises unless the API server answers (GET /version: any identity may read it)."""
        client.VersionApi(self._client).get_code(_request_timeout=REQUEST_TIMEOUT)

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None:
        try:
            lease = self._coordination.read_namespaced_lease(
                name, namespace, _request_timeout=LEASE_TIMEOUT
            )
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise
        spec = lease.spec
        return LeaseRecord(
            holder=(spec.holder_identity if spec else None) or "",
            acquire_time=_micro(spec.acquire_time if spec else None),
            renew_time=_micro(spec.renew_time if spec else None),
            lease_seconds=(spec.lease_duration_seconds if spec else None) or 0,
            transitions=(spec.lease_transitions if spec else None) or 0,
            resource_version=str((lease.metadata.resource_version if lease.metadata else "") or ""),
        )

    def write_lease(
        self, namespace: str, name: str, body: Mapping[str, Any], record: LeaseRecord | None
    ) -> bool:
        """Create the Lease, or replace it only if it is still the version read (the
        resourceVersion precondition): two replicas never both win one round."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if record is not None:
            metadata["resourceVersion"] = record.resource_version
        # A plain body: the client sends dicts as they are, and MicroTime strings stay exact.
        lease: Any = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": dict(body),
        }
        try:
            if record is None:
                self._coordination.create_namespaced_lease(
                    namespace, lease, field_manager=FIELD_MANAGER, _request_timeout=LEASE_TIMEOUT
                )
            else:
                self._coordination.replace_namespaced_lease(
                    name, namespace, lease, field_manager=FIELD_MANAGER,
                    _request_timeout=LEASE_TIMEOUT,
                )  # fmt: skip
        except client.ApiException as error:
            if error.status == 409:  # someone else wrote it first
                return False
            raise
        return True

    def create_event(self, key: EventKey, count: int, first: datetime, last: datetime) -> str:
        """A core/v1 Event about the resource (shown by `kubectl describe`), carrying `count`
        occurrences (see `events`); its name."""
        resource = key.resource
        name = f"{resource.name[:200]}.{uuid.uuid4().hex[:16]}"
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=name, namespace=resource.namespace),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION,
                kind=resource.kind,
                name=resource.name,
                namespace=resource.namespace,
                uid=key.uid,
            ),
            type=key.type,
            reason=key.reason,
            message=key.message,
            action="Compile",
            first_timestamp=first,
            last_timestamp=last,
            count=count,
            source=client.V1EventSource(component=FIELD_MANAGER),
            reporting_component=FIELD_MANAGER,
            reporting_instance=self._instance,
        )
        self._core.create_namespaced_event(
            resource.namespace, event, _request_timeout=REQUEST_TIMEOUT
        )
        return name

    def patch_event_count(self, namespace: str, name: str, count: int, last: datetime) -> bool:
        """Set an Event's `count` and `lastTimestamp` (a merge patch); False when the Event
        no longer exists (deleted, or expired by the API server's event TTL)."""
        body = {"count": count, "lastTimestamp": format_time(last)}
        try:
            self._core.patch_namespaced_event(
                name, namespace, body,
                _content_type="application/merge-patch+json",
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except client.ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def sync_configmap(
        self, namespace: str, name: str, proxy_config: ProxyConfig
    ) -> ConfigMapWrite:
        """Make the ConfigMap hold `proxy_config`; no write when it already does."""
        payload = proxy_config.to_canonical_json()
        for _ in range(CONFLICT_RETRIES):
            current = self._read_configmap(namespace, name)
            if current is None:
                try:
                    self._core.create_namespaced_config_map(
                        namespace,
                        _configmap(name, namespace, payload, proxy_config.hash, None),
                        field_manager=FIELD_MANAGER,
                        _request_timeout=REQUEST_TIMEOUT,
                    )
                except client.ApiException as error:
                    if error.status == 409:  # created meanwhile by someone else
                        continue
                    raise
                return ConfigMapWrite.CREATED
            annotations = (current.metadata.annotations if current.metadata else None) or {}
            data = current.data or {}
            if (
                annotations.get(HASH_ANNOTATION) == proxy_config.hash
                and data.get(CONFIG_KEY) == payload
            ):
                return ConfigMapWrite.UNCHANGED
            try:
                self._core.replace_namespaced_config_map(
                    name,
                    namespace,
                    _configmap(name, namespace, payload, proxy_config.hash, current),
                    field_manager=FIELD_MANAGER,
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except client.ApiException as error:
                if error.status == 409:  # changed since we read it: read again
                    log.info("configmap conflict, retrying namespace=%s name=%s", namespace, name)
                    continue
                raise
            return ConfigMapWrite.UPDATED
        raise ConflictPersisted(
            f"ConfigMap {namespace}/{name} changed under every one of {CONFLICT_RETRIES} writes"
        )

    def _read_configmap(self, namespace: str, name: str) -> client.V1ConfigMap | None:
        try:
            return self._core.read_namespaced_config_map(
                name, namespace, _request_timeout=REQUEST_TIMEOUT
            )
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise


def _configmap(
    name: str,
    namespace: str,
    payload: str,
    config_hash: str,
    current: client.V1ConfigMap | None,
) -> client.V1ConfigMap:
    """The ConfigMap to write: others' labels and annotations kept, ours set, `data`
    exactly the one key (nothing secret is in it: the configuration names Secrets, never
    their values)."""
    metadata = current.metadata if current is not None and current.metadata else None
    labels = dict((metadata.labels if metadata else None) or {})
    annotations = dict((metadata.annotations if metadata else None) or {})
    labels[MANAGED_BY_LABEL] = FIELD_MANAGER
    annotations[HASH_ANNOTATION] = config_hash
    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            labels=labels,
            annotations=annotations,
            resource_version=metadata.resource_version if metadata else None,
        ),
        data={CONFIG_KEY: payload},
    )


def describe_error(error: BaseException) -> str:
    """An error for a log line or a message: its type and the API status, never a
    response body (which may quote an object)."""
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    if status is not None:
        return f"{type(error).__name__}(status={status}, reason={reason})"
    return f"{type(error).__name__}: {error}"


def _micro(moment: datetime | None) -> str:
    return micro_time(moment) if moment is not None else ""


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
