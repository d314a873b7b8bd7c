"""The enumerations the policy model (the CRDs' specs) and the compiled configuration share."""

from __future__ import annotations

from enum import StrEnum


class Visibility(StrEnum):
    WATCHED = "Watched"
    UNWATCHED = "Unwatched"


class Ruling(StrEnum):
    ORDER = "Order"
    ONLY = "Only"
    AUTO = "Auto"


class Delivery(StrEnum):
    LIVE = "Live"
    BUFFERED = "Buffered"
    AUTO = "Auto"


class Dialect(StrEnum):
    # A plain OpenAI-compatible server (vLLM, llama.cpp, a direct host): one machine.
    OPENAI = "OpenAI"
    # An OpenRouter-style aggregator routing inside itself by the body field `provider`.
    AGGREGATOR = "Aggregator"


class TransportScope(StrEnum):
    PROVIDER = "Provider"
    MODEL = "Model"


class BypassField(StrEnum):
    """A top-level request field with which an OpenRouter-style aggregator routes beyond
    the request's one model: a caller that sends it could leave its role's models and
    routing. Spelled exactly as the request field."""

    # Model fallbacks: other models the aggregator may serve the request with.
    MODELS = "models"
    # The routing strategy among `models` (`fallback`).
    ROUTE = "route"
    # Prompt transforms (`middle-out`): the aggregator rewrites the request.
    TRANSFORMS = "transforms"
    # Plugins (web search, file parsing, response healing): other services in the path.
    PLUGINS = "plugins"
