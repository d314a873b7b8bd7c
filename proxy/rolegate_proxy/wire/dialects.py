"""The wire protocol each provider dialect speaks: the one table the request path asks.

A dialect says two things, kept apart: how to speak to the provider (here: build the
request, read a completion, a chunk and an error into `wire.answers` values) and whether
it routes among machines itself (`core.routing.ROUTES_MACHINES`; the routing it is sent
is spelled in `wire/aggregator.py`). Adding a dialect is a module implementing
`WireProtocol`, its `Dialect` value, and a row here and in `ROUTES_MACHINES`.

Every dialect's answers reach the client as OpenAI chat-completion bytes: the relay
forwards the provider's own (pass-through), spans of the bytes it read. A dialect with
another format would also need its events written in that shape for the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, Protocol

from rolegate_policy.enums import Dialect

from ..core.routing import MachineRouting
from . import openai
from .answers import Chunk, Completion, UpstreamError
from .caller_provider import CallerProvider
from .chat_request import EncodedBody


class StreamReader(Protocol):
    """Reads the events of one stream, in order."""

    def read(self, data: bytes) -> Chunk | str:
        """One event's `data`: its chunk, or, for a chunk that says nothing but its text
        (the model and machine it names already told by an earlier chunk), that text.
        Raises `sse.MalformedEvent` for data that is not a JSON object."""
        ...

    def rewrite(self, event: bytes, chunk: Chunk) -> bytes:
        """The event (one block, as framed) saying `chunk`'s text and reasoning instead of
        its own, all else it said kept: a seam's change to a provider's own bytes."""
        ...


class WireProtocol(Protocol):
    def chat_url(self, endpoint: str) -> str: ...

    def request_body(
        self,
        body: EncodedBody,
        model: str,
        routing: MachineRouting | None,
        caller: CallerProvider,
    ) -> bytes: ...

    def request_headers(self, key: str | None, *, stream: bool) -> dict[str, str]: ...

    def parse_completion(self, raw: bytes, *, named: bool) -> Completion | UpstreamError:
        """A 200 body; raises `answers.NotTheProtocol` for what is not an answer."""
        ...

    def stream_reader(self, *, named: bool) -> StreamReader: ...

    def parse_error(
        self, status: int | None, body: bytes | dict[str, Any], *, named: bool
    ) -> UpstreamError: ...


WIRE: Final[Mapping[Dialect, WireProtocol]] = MappingProxyType(
    {Dialect.OPENAI: openai, Dialect.AGGREGATOR: openai}
)
