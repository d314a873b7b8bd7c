"""Live reload (SPEC D3, D6): the proxy's configuration from a ConfigMap, watched via the API.

A watch, not a mounted volume: a volume-mounted ConfigMap reaches the pod up to a minute
or more later, while a watch sees a change as soon as the API server stores it. Each
payload is validated (schema and content hash) before it replaces the configuration;
a bad payload is counted and logged and the last good configuration stays. While the API
server is unreachable the proxy keeps routing on what it has and reconnects with capped,
jittered backoff; a watch that goes silent is bounded by its own timeouts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from rolegate_policy.config import (
    ProxyConfig,
)

from .kube_api import Backoff, ListWatch, Object

log = logging.getLogger("rolegate.proxy.config")

CONFIG_KEY = "config.json"


class ConfigRejected(ValueError):
    """A ConfigMap payload that cannot be served; the last good configuration stays."""


def parse_payload(configmap: dict[str, Any]) -> ProxyConfig:
    data = configmap.get("data") or {}
    text = data.get(CONFIG_KEY)
    if not isinstance(text, str):
        raise ConfigRejected(f"the ConfigMap has no `data.{CONFIG_KEY}` key")
    try:
        return ProxyConfig.from_json(text)
    except ValidationError as error:
        raise ConfigRejected(f"`data.{CONFIG_KEY}` is not a valid configuration: {error}") from None
    except ValueError as error:
        raise ConfigRejected(str(error)) from None


@dataclass
class ConfigMapSource:
    namespace: str
    name: str
    kubeconfig: Path | None = None
    # Set by the app: apply a validated configuration (returns True when it changed).
    on_config: Callable[[ProxyConfig], Any] | None = None
    on_api_state: Callable[[bool], None] | None = None
    on_rejected: Callable[[str], None] | None = None
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def describe(self) -> str:
        return f"configmap {self.namespace}/{self.name}"

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Forever: list the ConfigMap, then watch it (kube_api.ListWatch)."""
        watch = ListWatch(
            path=f"/api/v1/namespaces/{self.namespace}/configmaps",
            selector={"fieldSelector": f"metadata.name={self.name}"},
            describe=self.describe,
            kubeconfig=self.kubeconfig,
            on_listed=self._listed,
            on_event=self._event,
            on_api_state=self._api_up,
            log=log,
            backoff=self.backoff,
        )
        await watch.run(session)

    async def _listed(self, items: list[Object]) -> None:
        for item in items:
            await self._apply(item)

    async def _event(self, kind: str, obj: Object) -> None:
        if kind == "DELETED":
            log.warning("config source deleted source=%s keeping=last-good", self.describe)
        else:
            await self._apply(obj)

    async def _apply(self, configmap: dict[str, Any]) -> None:
        try:
            config = parse_payload(configmap)
        except ConfigRejected as error:
            log.error("config rejected source=%s reason=%s", self.describe, error)
            if self.on_rejected is not None:
                self.on_rejected(str(error))
            return
        if self.on_config is not None:
            await self.on_config(config)

    def _api_up(self, up: bool) -> None:
        if self.on_api_state is not None:
            self.on_api_state(up)
