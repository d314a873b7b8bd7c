"""The client connections' limits: how long a request may take to arrive, how long an idle
keep-alive connection is kept, and how many connections are served at once.

aiohttp's server bounds none of this by itself: a client that trickles a request head a
byte at a time holds its connection, and a file descriptor, for as long as it likes. The
limits are on reading a request and on the silence between requests, never on a response:
a stream that runs for minutes is bounded only by its upstream's limits (flow/upstream.py).

* **Head** (`header_seconds`): a connection must send a complete request head within this
  long of opening, and of the first byte of each later request on it. Past it the
  connection is closed: with a 408 when part of a head had come, without a word when
  nothing had (an unasked-for 408 on a silent connection could be read by the client as
  the answer to the request it sends next).
* **Body** (`body_seconds`): from the head to the body's last byte. Past it, reading the
  body fails with `BodyTimedOut`: the call answers 408 and the connection closes.
* **Idle** keep-alive connections: aiohttp's own `keepalive_timeout` (set where the runner
  is made, edge/server.py).
* **Bound** (`max_connections`): one connection more than this is answered 503 at once,
  without its request being read, then closed. It is never left waiting.

The 408 after a head's timeout and the 503 are written straight to the socket, since no
request exists to answer; both are in the OpenAI error shape and close the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from ..wire.errors import ProxyError
from .calls import BodyTimedOut
from .error_shape import OpenAIErrorHandler

log = logging.getLogger("rolegate.proxy")

# A refused connection is drained this long at most (its request read and dropped), so
# that the 503 is not lost to a reset; the client's own close ends it sooner.
REFUSAL_LINGER_SECONDS = 1.0
# Refusals are logged at most this often (a flood must not flood the log too).
REFUSAL_LOG_SECONDS = 10.0

_Task = asyncio.Task[None]
_RequestFactory = Callable[
    [RawRequestMessage, StreamReader, web.RequestHandler, AbstractStreamWriter, _Task],
    web.BaseRequest,
]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_seconds: float
    body_seconds: float
    max_connections: int


def head_timed_out(seconds: float) -> ProxyError:
    return ProxyError(
        408,
        f"The request headers did not arrive within {seconds:g} s; send the whole request "
        "head at once, or raise the proxy's --header-timeout-seconds.",
        code="header_timeout",
        close_connection=True,
    )


def too_many_connections(limit: int) -> ProxyError:
    return ProxyError(
        503,
        f"The proxy has too many open connections (its limit is {limit}); retry later, "
        "reuse keep-alive connections instead of opening new ones, or raise the proxy's "
        "--max-connections.",
        error_type="service_unavailable",
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )


def raw_response(error: ProxyError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes its connection, for a socket with no
    request to answer."""
    body = json.dumps(error.payload(), ensure_ascii=False).encode("utf-8")
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


class GuardedHandler(OpenAIErrorHandler):
    """One client connection, with the head and body limits and a place under the bound."""

    __slots__ = (
        "_awaiting_head",
        "_body_late",
        "_body_timer",
        "_counted",
        "_guard",
        "_head_begun",
        "_head_deadline",
        "_head_timer",
        "_linger",
        "_refused",
    )

    def __init__(self, guard: GuardedServer, **options: Any) -> None:
        super().__init__(guard, **options)
        self._guard = guard
        # Waiting for a request head: from the connection's start, and again after each
        # response, until the next request begins.
        self._awaiting_head = False
        # Some byte of that head has come.
        self._head_begun = False
        # When the head under way is late (None: no head is under way). One timer checks
        # it, re-armed only when it finds the deadline moved on (as aiohttp keeps its
        # keep-alive timer): a timer made and cancelled for every request cost more than
        # the rest of this class.
        self._head_deadline: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_late = False
        self._counted = False
        # Over the bound: the connection's transport while the 503 is delivered.
        self._refused: asyncio.Transport | None = None
        self._linger: asyncio.TimerHandle | None = None

    # -- the bound ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open >= guard.limits.max_connections:
            self._refuse(cast(asyncio.Transport, transport))
            return
        guard.open += 1
        self._counted = True
        self._awaiting_head = True
        self._head_due(self._loop.time() + guard.limits.header_seconds)
        super().connection_made(transport)

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 before reading anything, then close once the client has had it: its
        request is read and dropped meanwhile, for a close with unread bytes would reset the
        connection and could lose the answer."""
        guard = self._guard
        self._refused = transport
        guard.refused.add(self)
        transport.write(guard.busy)
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self._loop.call_later(REFUSAL_LINGER_SECONDS, transport.close)
        guard.note_refusal()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            # aiohttp's side of the connection never started: nothing of it to tear down.
            self._guard.refused.discard(self)
            self._refused = None
            if self._linger is not None:
                self._linger.cancel()
            return
        self._stop_head_timer()
        self._stop_body_timer()
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        super().connection_lost(exc)

    def close_refused(self) -> None:
        if self._refused is not None:
            self._refused.close()

    # -- the head ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # read and dropped
        if self._awaiting_head and data:
            self._head_begun = True
            if self._head_deadline is None:
                self._head_due(self._loop.time() + self._guard.limits.header_seconds)
        super().data_received(data)

    def _head_due(self, deadline: float) -> None:
        self._head_deadline = deadline
        if self._head_timer is None:
            self._head_timer = self._loop.call_at(deadline, self._head_check)

    def _head_check(self) -> None:
        self._head_timer = None
        deadline = self._head_deadline
        if deadline is None or not self._awaiting_head or self.transport is None:
            return  # no head under way: the next one's first byte sets the timer again
        if self._loop.time() < deadline:
            # A later head than the one this timer was set for.
            self._head_timer = self._loop.call_at(deadline, self._head_check)
            return
        seconds = self._guard.limits.header_seconds
        if self._head_begun:
            log.info("closed a connection whose request head took over %g s", seconds)
            self.transport.write(self._guard.head_late)
        self.force_close()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # -- the body ----------------------------------------------------------------------------

    def request_began(self, payload: StreamReader) -> None:
        """A request head is in (the server's request factory calls this): its time is up,
        its body's begins unless the body is in already."""
        self._awaiting_head = False
        self._head_begun = False
        self._head_deadline = None  # (its timer, if still set, finds none when it fires)
        if not payload.is_eof():
            self._body_timer = self._loop.call_later(
                self._guard.limits.body_seconds, self._body_late_for, payload
            )
            payload.on_eof(self._stop_body_timer)

    def _body_late_for(self, payload: StreamReader) -> None:
        self._body_timer = None
        if payload.is_eof():
            return
        self._body_late = True
        payload.set_exception(BodyTimedOut(self._guard.limits.body_seconds))

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        self._stop_body_timer()
        finished = await super().finish_response(request, resp, start_time)
        if self._body_late:
            # The rest of that body will never be read: nothing more on this connection can.
            self.force_close()
        else:
            self._awaiting_head = True
        return finished


class GuardedServer(web.Server):
    """The low-level server: builds `GuardedHandler`s, and counts the open connections."""

    def __init__(
        self,
        handler: Any,
        *,
        limits: ConnectionLimits,
        request_factory: _RequestFactory,
        **options: Any,
    ) -> None:
        super().__init__(handler, request_factory=self._begin_request, **options)
        self._make_request_of_app = request_factory
        self.limits = limits
        # Connections served now (a refused one is not).
        self.open = 0
        self.refused: set[GuardedHandler] = set()
        self.busy = raw_response(too_many_connections(limits.max_connections))
        self.head_late = raw_response(head_timed_out(limits.header_seconds))
        self._refusals = 0
        self._refusals_logged_at: float | None = None

    def _begin_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        cast(GuardedHandler, protocol).request_began(payload)
        return self._make_request_of_app(message, payload, protocol, writer, task)

    def __call__(self) -> web.RequestHandler:
        # Private API: web.Server builds a plain RequestHandler from `_loop` and `_kwargs`
        # (the handler settings of AppRunner and the app); ours gets the very same ones.
        return GuardedHandler(self, loop=self._loop, **self._kwargs)

    def note_refusal(self) -> None:
        self._refusals += 1
        now = self._loop.time()
        logged = self._refusals_logged_at
        if logged is None or now - logged >= REFUSAL_LOG_SECONDS:
            self._refusals_logged_at = now
            log.warning(
                "refused %d connection(s) with a 503: %d are open, the limit "
                "(--max-connections)",
                self._refusals, self.open,
            )  # fmt: skip
            self._refusals = 0

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for handler in list(self.refused):
            handler.close_refused()


class ProxyRunner(web.AppRunner):
    """A web.AppRunner whose connections have the limits above and answer protocol errors
    in the OpenAI shape.

    aiohttp offers no setting for the connection handler's class; `_make_server` (the
    runner's private hook that builds the server from the app) is the one place to swap
    it. The server aiohttp built is copied, so every setting it carries is kept.
    """

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, **options: Any):
        super().__init__(app, **options)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        built = await super()._make_server()
        return GuardedServer(
            built.request_handler,
            limits=self._limits,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=built._loop,
            **built._kwargs,
        )
