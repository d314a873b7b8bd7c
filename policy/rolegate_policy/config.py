"""The compiled proxy configuration: what the proxy needs to route, and nothing secret.

This is the contract between `compile` (pure, shared by the operator and the standalone
proxy) and the proxy. It is serialised to canonical JSON and identified by the SHA-256 of
that JSON, so an unchanged input never produces a different configuration.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

CONFIG_FORMAT_VERSION = 1


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Visibility(StrEnum):
    WATCHED = "Watched"
    UNWATCHED = "Unwatched"


class Ruling(StrEnum):
    ORDER = "Order"
    ONLY = "Only"
    AUTO = "Auto"


class Dialect(StrEnum):
    # A plain OpenAI-compatible server (vLLM, llama.cpp, a direct host): one machine.
    OPENAI = "OpenAI"
    # An OpenRouter-style aggregator routing inside itself by the body field `provider`.
    AGGREGATOR = "Aggregator"


class TransportScope(StrEnum):
    PROVIDER = "Provider"
    MODEL = "Model"


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
    continues_partial_message: bool = False


class CompiledModel(Frozen):
    name: str
    machines: tuple[CompiledMachine, ...]


class BreakerSettings(Frozen):
    cooldown_seconds: float = 30.0
    max_cooldown_seconds: float = 600.0
    backoff_multiplier: float = 2.0
    jitter_fraction: float = 0.1
    novel_signature_count: int = 2
    familiar_signature_count: int = 5
    novelty_window_seconds: float = 86400.0
    rate_threshold: float = 0.25
    rate_window: int = 100
    rate_min_samples: int = 20
    transport_scope: TransportScope = TransportScope.PROVIDER


class DegradedOutputSettings(Frozen):
    detect_empty: bool = True
    detect_mangled: bool = True


class TimeoutSettings(Frozen):
    connect_seconds: float = 5.0
    # Longest silence tolerated between two bytes of an answer before the attempt is
    # abandoned; the role's patience lowers it further per request.
    idle_seconds: float = 60.0


class CompiledProvider(Frozen):
    name: str
    source: str
    endpoint: str
    dialect: Dialect
    api_key_secret_ref: SecretRef | None = None
    models: tuple[CompiledModel, ...]
    breaker: BreakerSettings = BreakerSettings()
    degraded_output: DegradedOutputSettings = DegradedOutputSettings()
    timeouts: TimeoutSettings = TimeoutSettings()

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


class ProxyConfig(Frozen):
    format_version: int = CONFIG_FORMAT_VERSION
    roles: tuple[CompiledRole, ...] = ()
    providers: tuple[CompiledProvider, ...] = ()
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
