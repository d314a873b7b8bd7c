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
