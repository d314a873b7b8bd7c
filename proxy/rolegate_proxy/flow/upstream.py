"""Sending one arm to its upstream, and reading why it failed when it did.

`send` posts the attempt and returns the upstream's response once its status line and
headers are in. A pooled keep-alive connection the upstream had already closed fails
before any header arrives; that is nobody's fault (`StaleConnection`): the caller records
it and sends again on a fresh connection, once. Redirects are never followed (they would
carry the prompt to another host): a 3xx is an error status like a 5xx. Every failure is
an `ArmFailed` with its cause (see core/arm_end.py) and, for an error answer, the error as
the provider's wire protocol reads it (`wire/dialects.py`).
"""

from __future__ import annotations

import contextvars
import errno
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

from rolegate_policy.config import SecretRef
from rolegate_policy.enums import Dialect

from ..core.arm_end import Cause
from ..core.exclusions import is_redirect
from ..core.load import Load
from ..core.routing import Attempt
from ..wire.answers import UpstreamError
from ..wire.chat_request import ChatRequest
from ..wire.dialects import WIRE, WireProtocol
from .answer_bounds import AnswerBounds
from .deadlines import Deadlines

# What a failed read or write of an upstream's answer raises.
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)
# A pooled connection the peer had closed: the request met a reset or a close before any
# byte of an answer.
_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


class KeySource(Protocol):
    """Where providers' API keys come from (edge/credentials.py); never blocks."""

    def key_for(self, ref: SecretRef) -> str | None: ...

    def where(self, ref: SecretRef) -> str: ...


class _Reuse:
    """Set when the request went out on a pooled connection (see `ReuseTellingConnector`)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


# The reuse record of the request being sent; `send` sets it, the connector marks it. The
# connector runs in the sending task, so the context reaches it without a per-request trace
# (aiohttp's request tracing costs a tenth of a proxied request).
_SENDING: contextvars.ContextVar[_Reuse | None] = contextvars.ContextVar(
    "rolegate_sending", default=None
)


class ReuseTellingConnector(aiohttp.TCPConnector):
    """The pooled session's connector: it tells `send` which requests reused a connection,
    so that only a reused one is ever taken for stale (a fresh connection reset before an
    answer is the upstream refusing)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._opened: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()

    async def connect(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        if protocol is not None:
            if protocol in self._opened:
                reuse = _SENDING.get()
                if reuse is not None:
                    reuse.reused = True
            else:
                self._opened.add(protocol)
        return connection


# Which request headers: a provider's dialect and key reference, and whether streamed.
_HeaderSlot = tuple[Dialect, SecretRef | None, bool]


@dataclass(frozen=True, slots=True)
class Upstreams:
    """What every arm is sent with: one pooled session, one that never reuses a connection
    (for the retry of a stale one), the keys, and the request's id."""

    pooled: aiohttp.ClientSession
    fresh: aiohttp.ClientSession
    keys: KeySource
    # Every arm's silence bound (on one timer for them all).
    deadlines: Deadlines = field(default_factory=Deadlines)
    # How much of an answer is read (SPEC E8).
    bounds: AnswerBounds = field(default_factory=AnswerBounds)
    # Every arm in flight, per machine (SPEC B8): the routing's queues.
    load: Load = field(default_factory=Load)
    # The request headers last built per (dialect, key reference, streamed), with the key
    # they were built with: every arm to a provider sends the same ones until its key
    # changes (read-only: aiohttp copies them into each request).
    _headers: dict[_HeaderSlot, tuple[str | None, Mapping[str, str]]] = field(default_factory=dict)

    def headers(
        self, wire: WireProtocol, attempt: Attempt, key: str | None, *, stream: bool
    ) -> Mapping[str, str]:
        """`wire.request_headers`, built once per provider key and kind of request."""
        provider = attempt.provider
        slot = (provider.dialect, provider.api_key_secret_ref, stream)
        found = self._headers.get(slot)
        if found is None or found[0] != key:
            found = self._headers[slot] = (
                key,
                MappingProxyType(wire.request_headers(key, stream=stream)),
            )
        return found[1]


# ClientTimeouts by (connect, read) seconds: the same few for every arm (a non-streamed
# arm has no read timeout, see `send`); bounded, as a streamed arm's read bound varies.
_TIMEOUTS: dict[tuple[float, float | None], aiohttp.ClientTimeout] = {}


def _timeout(connect: float, read: float | None) -> aiohttp.ClientTimeout:
    timeout = _TIMEOUTS.get((connect, read))
    if timeout is None:
        if len(_TIMEOUTS) >= 256:
            _TIMEOUTS.clear()
        timeout = _TIMEOUTS[(connect, read)] = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect, sock_read=read
        )
    return timeout


class ArmFailed(Exception):
    """An arm that produced no usable answer, and why (in our words, never the upstream's)."""

    def __init__(
        self,
        cause: Cause,
        detail: str,
        *,
        error: UpstreamError | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail
        self.error = error
        self.retry_after = retry_after


class StaleConnection(ArmFailed):
    def __init__(self) -> None:
        super().__init__(
            Cause.STALE_CONNECTION,
            "a pooled connection the upstream had closed; sent again on a fresh one",
        )


class Silence(NamedTuple):
    """How long an arm may stay silent, and which limit that is: the provider's own idle
    limit (a silence past it is the upstream's fault, a stall) or the share of the
    request's patience this arm may use (a silence past that is our deadline)."""

    seconds: float
    is_idle_limit: bool

    @classmethod
    def for_arm(cls, attempt: Attempt, budget: float, *, stream: bool) -> Silence:
        idle = attempt.provider.timeouts.idle_seconds
        if stream and idle <= budget:
            return cls(idle, True)
        return cls(max(budget, 0.05), False)

    @property
    def cause(self) -> Cause:
        return Cause.STALL if self.is_idle_limit else Cause.DEADLINE


async def send(
    upstreams: Upstreams,
    attempt: Attempt,
    chat: ChatRequest,
    silence: Silence,
    *,
    fresh: bool,
    extra_headers: Mapping[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """POST the attempt; the response once its headers are in (the caller reads the body).
    `extra_headers`: this arm's own (its trace context). Raises ArmFailed (StaleConnection
    for a dead pooled connection)."""
    ref = attempt.provider.api_key_secret_ref
    key = None if ref is None else upstreams.keys.key_for(ref)
    if ref is not None and key is None:
        raise ArmFailed(
            Cause.NO_CREDENTIALS,
            f"no API key for Secret {ref.name}/{ref.key}: set the {upstreams.keys.where(ref)}",
        )
    session = upstreams.fresh if fresh else upstreams.pooled
    # A streamed arm's reads are bounded by its silence. A non-streamed one is bounded as a
    # whole by its caller (`arms.complete`: the silence from its sending), which always
    # ends it before a read bound of the same length, started later, could: no per-read
    # timer for it.
    timeout = _timeout(
        attempt.provider.timeouts.connect_seconds, silence.seconds if chat.stream else None
    )
    reuse = _Reuse()
    sending = _SENDING.set(reuse)
    wire = WIRE[attempt.provider.dialect]
    headers = upstreams.headers(wire, attempt, key, stream=chat.stream)
    if extra_headers:
        headers = {**headers, **extra_headers}
    try:
        return await session.post(
            wire.chat_url(attempt.provider.endpoint),
            data=wire.request_body(chat.encoded, attempt.model.name, attempt.routing, chat.caller),
            headers=headers,
            timeout=timeout,
            allow_redirects=False,
        )
    except TRANSPORT_ERRORS as error:
        if reuse.reused and _stale(error):
            raise StaleConnection() from None
        raise failed_in_transport(error, silence, headers_in=False, content_in=False) from None
    finally:
        _SENDING.reset(sending)


def _stale(error: BaseException) -> bool:
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return True
    return (
        isinstance(error, aiohttp.ClientOSError)
        and not isinstance(error, aiohttp.ClientConnectorError)
        and error.errno in _STALE_ERRNOS
    )


def failed_in_transport(
    error: BaseException, silence: Silence, *, headers_in: bool, content_in: bool
) -> ArmFailed:
    """What a transport error means for the arm. A silence: past its limit before any
    content (see `Silence`), or a producing stream gone quiet (always a stall). Otherwise a
    connection that could not be made or was dropped before the headers, or an answer cut
    short."""
    if isinstance(error, (TimeoutError, aiohttp.ServerTimeoutError)):
        if content_in:
            return ArmFailed(Cause.STALL, f"went silent mid-answer for {silence.seconds:g} s")
        limit = "its idle limit" if silence.is_idle_limit else "this arm's share of the patience"
        return ArmFailed(silence.cause, f"silent for {silence.seconds:g} s ({limit})")
    if isinstance(error, aiohttp.ClientConnectorError):
        return ArmFailed(Cause.REFUSED, f"cannot connect ({error.os_error.strerror or 'refused'})")
    if not headers_in:
        return ArmFailed(Cause.REFUSED, "the connection was dropped before an answer")
    return ArmFailed(Cause.CUT, "the answer was cut off before its end")


async def failed_with_status(
    response: aiohttp.ClientResponse, wire: WireProtocol, *, named: bool
) -> ArmFailed:
    """An error status: its body is read (bounded) to classify it, then dropped."""
    try:
        body = await response.content.read(64 * 1024)
    except TRANSPORT_ERRORS:
        body = b""
    error = wire.parse_error(response.status, body, named=named)
    cause = Cause.REJECTED if error.request_fault is not None else Cause.HTTP_ERROR
    # A redirect is the upstream's fault like a 5xx: its Location is never followed, for
    # the request would carry the prompt and the API key to wherever it points.
    redirect = ", a redirect (never followed)" if is_redirect(response.status) else ""
    return ArmFailed(
        cause, f"answered {error.describe()}{redirect}", error=error,
        retry_after=response.headers.get("Retry-After"),
    )  # fmt: skip
