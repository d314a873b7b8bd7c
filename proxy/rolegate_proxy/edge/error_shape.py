"""Every error the server answers, in the OpenAI error shape (SPEC E2), not aiohttp's text.

Two places make aiohttp's plain-text errors, both in the low-level connection handler:
the HTTPExceptions raised around the handlers (the router's 404 and 405, a body over the
size limit on any route), which it sends as they are; and `handle_error`, which answers
what never reached a route (a request the HTTP parser refused) and what a handler raised
unexpectedly (500). `OpenAIErrorHandler` is a connection handler that reshapes both (the
server runs its subclass in edge/connections.py). It does so at the connection, not in a
middleware: a middleware would wrap every request in two more coroutines, about a fortieth
of a proxied request's CPU.

Messages are ours and say what to fix; none echoes request text (a path, a method, a
header), which is the client's and could be anything. And a client's mistake is never
logged as ours: not a malformed request, nor a broken body left unread behind a refusal
(`_then_drop_body`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from http import HTTPStatus
from typing import Any

from aiohttp import hdrs, http_exceptions, web
from aiohttp.streams import StreamReader

from ..wire.errors import ProxyError
from .calls import BodyTimedOut, body_timed_out, body_too_large, unsupported_encoding

log = logging.getLogger("rolegate.proxy")

# The app's body limit, for the 413's message (set where the app is made).
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)


def reshaped_http_error(request: web.BaseRequest, exc: web.HTTPException) -> web.StreamResponse:
    """An HTTP error aiohttp raised around the handlers (routing, body size), in our shape.
    Redirects and the like are no errors, and a JSON body is already an answer: those are
    sent as they are."""
    if exc.status < 400 or exc.content_type == "application/json":
        return exc
    if not isinstance(request, web.Request):
        return _status_error(exc.status).response(_kept_headers(exc))
    return _reshaped(request, exc, request.app[MAX_BODY_BYTES]).response(_kept_headers(exc))


def _reshaped(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> ProxyError:
    if isinstance(exc, web.HTTPNotFound):
        return ProxyError(
            404,
            f"No such endpoint; check the method and path. rolegate serves {_endpoints(request)}.",
            code="unknown_url",
        )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ProxyError(
            405,
            f"This path does not take that method: it accepts {allowed}. "
            f"rolegate serves {_endpoints(request)}.",
            code="method_not_allowed",
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(max_body_bytes)
    if isinstance(exc, BodyTimedOut):
        return body_timed_out(exc.seconds)
    return _status_error(exc.status)


def _endpoints(request: web.Request) -> str:
    """The app's own routes (our text, never the client's): what a client may call."""
    routes = request.app.router.routes()
    # aiohttp adds a HEAD route beside every GET one; naming it adds nothing.
    return ", ".join(
        f"{route.method} {route.resource.canonical}"
        for route in routes
        if route.resource is not None and route.method != hdrs.METH_HEAD
    )


def _kept_headers(exc: web.HTTPException) -> dict[str, str]:
    """The exception's headers (Allow on a 405) but those describing its text body."""
    dropped = {hdrs.CONTENT_TYPE.lower(), hdrs.CONTENT_LENGTH.lower()}
    return {name: value for name, value in exc.headers.items() if name.lower() not in dropped}


def _status_error(status: int) -> ProxyError:
    """An HTTP error no rule above words: named by its status alone."""
    phrase = HTTPStatus(status).phrase
    if status >= 500:
        return ProxyError(
            status,
            f"The proxy could not handle this request ({status} {phrase}); retry it.",
            error_type="server_error",
            code="internal_error",
        )
    return ProxyError(
        status, f"The proxy refused this request ({status} {phrase}).", code="invalid_request"
    )


# --- the connection handler -------------------------------------------------------------------

INTERNAL = ProxyError(
    500,
    "The proxy failed on this request: a bug in rolegate, not in the request. Retry it; "
    "the proxy's log has the details.",
    error_type="server_error",
    code="internal_error",
)
TIMED_OUT = ProxyError(
    504,
    "The proxy timed out handling this request; retry it.",
    error_type="server_error",
    code="timeout",
)

# What the parser refused, most specific first (BadHttpMethod is a BadStatusLine). aiohttp's
# C parser raises these few kinds, and a plain BadHttpMessage for the rest.
_REQUEST_LINE = (
    "The request line is malformed; send `METHOD /path HTTP/1.1`, "
    "e.g. `POST /v1/chat/completions HTTP/1.1`."
)
_PARSER_ERRORS: tuple[tuple[type[Exception], str, str], ...] = (
    (
        http_exceptions.LineTooLong,
        "header_too_large",
        "The request line or a header is over the proxy's size limit; shorten the URL "
        "or the headers.",
    ),
    (
        http_exceptions.BadHttpMethod,
        "invalid_request_line",
        "The request does not start with an HTTP method; send an HTTP/1.1 request such as "
        "`POST /v1/chat/completions HTTP/1.1` (HTTPS to a plain-HTTP port looks like this).",
    ),
    (http_exceptions.BadStatusLine, "invalid_request_line", _REQUEST_LINE),
    (http_exceptions.InvalidURLError, "invalid_request_line", _REQUEST_LINE),
)
_NOT_HTTP = (
    "The request is not valid HTTP/1.1; check that it has a Host header, that each header "
    "is `Name: value` with a token name, that there are not too many, and that the body is "
    "framed by a matching Content-Length or by well-formed chunks (never both)."
)


def _parser_error(exc: BaseException | None) -> ProxyError:
    if isinstance(exc, http_exceptions.ContentEncodingError):
        # br or zstd without its library installed: aiohttp refuses it with the headers.
        return unsupported_encoding()
    for kind, code, message in _PARSER_ERRORS:
        if isinstance(exc, kind):
            return ProxyError(400, message, code=code)
    return ProxyError(400, _NOT_HTTP, code="invalid_http")


def _server_error(status: int) -> ProxyError:
    return {INTERNAL.status: INTERNAL, TIMED_OUT.status: TIMED_OUT}.get(status) or (
        _status_error(status)
    )


# What reading a body the client broke raises: the parser's verdict on its framing or its
# Content-Encoding (wrapped as RequestPayloadError), the body limit's BodyTimedOut (an HTTP
# error), the client gone.
_BROKEN_BODY = (
    web.RequestPayloadError,
    http_exceptions.HttpProcessingError,
    web.HTTPException,
    ConnectionError,
)


class OpenAIErrorHandler(web.RequestHandler):
    """One connection, whose error answers (routing, the parser's, a handler's crash) are
    JSON."""

    __slots__ = ()

    def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> Coroutine[Any, Any, tuple[web.StreamResponse, bool]]:
        # Every response passes here, an HTTPException a handler or the router raised too
        # (aiohttp sends the exception itself as the response). aiohttp's own finishing is
        # handed back to be awaited, not awaited here: a coroutine less per response.
        if isinstance(resp, web.HTTPException):
            resp = reshaped_http_error(request, resp)
        finishing = super().finish_response(request, resp, start_time)
        body = request.content
        if body.is_eof() or not self._lingering_time:
            return finishing  # the body was read (or there was none): the usual case
        return self._then_drop_body(finishing, body)

    async def _then_drop_body(
        self,
        finishing: Coroutine[Any, Any, tuple[web.StreamResponse, bool]],
        body: StreamReader,
    ) -> tuple[web.StreamResponse, bool]:
        """The answer, then the rest of a body the handler never read (a request refused
        before its body was looked at: no credential, an unknown path), read and dropped.

        aiohttp would do the same after the response (its "lingering close", so that the
        client is not reset before it reads the answer), but there a body that turns out
        broken (not the gzip it claims, badly chunked) raises into its request loop, which
        logs it as an unhandled exception: an ERROR traceback for the client's mistake.
        Here the read is the same, within the same lingering time; a body broken or still
        arriving after it only ends the connection, logged at DEBUG."""
        finished = await finishing
        if finished[1]:
            return finished  # the client is gone: aiohttp ends the connection
        try:
            async with asyncio.timeout(self._lingering_time):
                while not body.is_eof():
                    await body.readany()
            return finished
        except TimeoutError:
            log.debug("closed a connection whose unread request body was still arriving")
        except _BROKEN_BODY as exc:
            log.debug("closed a connection whose unread request body was broken (%s)",
                      type(exc).__name__)  # fmt: skip
        # Nothing more on the connection can be read: its framing is lost.
        self.force_close()
        return finished

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # Our failure: aiohttp's own handling logs the traceback (never the body) and
            # gives up when the response had begun. Its text answer is replaced below.
            super().handle_error(request, status, exc, message)
            error = _server_error(status)
        else:
            # The client's malformed request, not our failure: no traceback at ERROR. The
            # parser's `message` quotes the request's bytes; it stays out of log and answer.
            log.info(
                "refused a malformed HTTP request from %s (%s)",
                request.remote, type(exc).__name__,
            )  # fmt: skip
            error = _parser_error(exc)
        response = error.response()
        # As aiohttp does: after a parser error the stream's framing is lost.
        response.force_close()
        return response
