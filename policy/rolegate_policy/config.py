"""The compiled proxy configuration: what the proxy needs to route, and nothing secret.

This is the contract between `compile` (pure, shared by the operator and the standalone
proxy) and the proxy. It is serialised to canonical JSON and identified by the SHA-256 of
that JSON, so an unchanged input never produces a different configuration.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rolegate_policy.enums import BypassField, Delivery, Dialect, Ruling, Visibility
from rolegate_policy.model import (
    BreakerSpec,
    DegradedOutputSpec,
    RetrySpec,
    TimeoutsSpec,
)

CONFIG_FORMAT_VERSION = 1


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SecretRef(Frozen):
    """Names a Kubernetes Secret key; the key's value never appears in config."""

    name: str
    key: str


class CompiledMachine(Frozen):
    name: str
    ttft_seconds: float | None = None
    tokens_per_second: float | None = None
    price_input_per_mtok: float | None = None
    price_output_per_mtok: float | None = None
    # Requests it serves at once (None: learned, see core/load.py).
    max_concurrency: int | None = None
    continues_partial_message: bool = False
    echoes_partial_message: bool = False


class CompiledModel(Frozen):
    name: str
    machines: tuple[CompiledMachine, ...]

    def machine(self, name: str) -> CompiledMachine | None:
        for machine in self.machines:
            if machine.name == name:
                return machine
        return None


class CompiledProvider(Frozen):
    name: str
    source: str
    endpoint: str
    dialect: Dialect
    api_key_secret_ref: SecretRef | None = None
    models: tuple[CompiledModel, ...]
    # The spec models themselves: their defaults are the defaults, stated once.
    breaker: BreakerSpec = BreakerSpec()
    degraded_output: DegradedOutputSpec = DegradedOutputSpec()
    timeouts: TimeoutsSpec = TimeoutsSpec()
    # Each attempt carries the W3C trace context upstream (the ProviderPolicy says so).
    propagate_trace_context: bool = False

    def model(self, name: str) -> CompiledModel | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


class CompiledRole(Frozen):
    name: str
    source: str
    models: tuple[str, ...]
    patience_seconds: float
    visibility: Visibility
    ruling: Ruling
    # `Auto` resolved to `Order` or `Only`, with the reason a reviewer reads.
    effective_ruling: Ruling
    ruling_reason: str
    expected_output_tokens: int
    # Operational scores this close count as equal quality; cost breaks the tie (SPEC C5).
    quality_tolerance: float = 0.05
    # A machine expected this many times slower than the fastest of equal quality never
    # leads (SPEC B3, B8).
    speed_tolerance: float = 1.5
    # The share of decisions that explore (SPEC G3); None: the proxy's --explore-share.
    exploration_share: float | None = None
    # `Auto` resolved to `Live` or `Buffered` (SPEC E5).
    delivery: Delivery = Delivery.LIVE
    # The spec model itself: its defaults are the defaults, stated once.
    retry: RetrySpec = RetrySpec()
    # Top-level request fields a caller may send though they route beyond the role
    # (passed through unchanged); any other is refused with a 400 naming it.
    caller_may_bypass: tuple[BypassField, ...] = ()


class CompiledGrant(Frozen):
    """Who may use which roles (an AccessGrant), with its subjects sorted by kind."""

    name: str  # namespace/name, unique
    source: str
    roles: tuple[str, ...]
    # `namespace/name` of each ServiceAccount (its namespace defaulted to the grant's).
    service_accounts: tuple[str, ...] = ()
    # Namespaces whose every ServiceAccount the grant is for.
    namespaces: tuple[str, ...] = ()
    api_keys: tuple[SecretRef, ...] = ()
    anonymous: bool = False
    # Limits its callers share (None: no limit of that kind).
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    cost_per_day_usd: float | None = None
    admin: bool = False

    @property
    def limited(self) -> bool:
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.cost_per_day_usd is not None
        )


class ProxyConfig(Frozen):
    format_version: int = CONFIG_FORMAT_VERSION
    roles: tuple[CompiledRole, ...] = ()
    providers: tuple[CompiledProvider, ...] = ()
    grants: tuple[CompiledGrant, ...] = ()
    hash: str = Field(default="", description="sha256 of the canonical JSON without this field")

    def role(self, name: str) -> CompiledRole | None:
        for role in self.roles:
            if role.name == name:
                return role
        return None

    def provider(self, name: str) -> CompiledProvider | None:
        for provider in self.providers:
            if provider.name == name:
                return provider
        return None

    def to_canonical_json(self) -> str:
        return canonical_json(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ProxyConfig:
        """Load a serialised configuration and check that its hash matches its content."""
        config = cls.model_validate_json(text)
        expected = content_hash(config)
        if config.hash != expected:
            raise ValueError(
                f"configuration hash mismatch: payload says {config.hash!r}, content is "
                f"{expected!r}; the payload was edited by hand or truncated"
            )
        return config


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(config: ProxyConfig) -> str:
    body = config.model_dump(mode="json", exclude={"hash"})
    return "sha256:" + hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def with_hash(config: ProxyConfig) -> ProxyConfig:
    return config.model_copy(update={"hash": content_hash(config)})
