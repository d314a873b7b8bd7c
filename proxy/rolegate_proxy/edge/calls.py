"""`POST /v1/chat/completions` at the edge: read and check the request, hand it to the
dispatcher, and emit its one outcome whatever happened (SPEC C7).

The status the outcome records is what the client got: the answer's, rolegate's error's,
or 499 (nginx's convention) when the client went away before its answer was complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from functools import partial

from aiohttp import hdrs, http_exceptions, web

from ..core.decisions import Decision
from ..core.outcomes import Outcome, OutcomeKind
from ..flow import tracing
from ..wire.caller_provider import refuse_unreachable, role_machines
from ..wire.chat_request import (
    ROLE_HEADER,
    choose_role,
    parse_body,
    unknown_role,
    validate_chat_request,
)
from ..wire.errors import ProxyError
from .callers import OverLimit, rate_limited
from .headers import readable
from .state import ProxyState

CLIENT_GONE = 499


class Call:
    """One client request at the edge."""

    def __init__(self, state: ProxyState, request: web.Request) -> None:
        self.state = state
        self.request = request
        self.config = state.config
        self.started = state.dispatcher.now()
        self.request_id = request_id(request)
        self.headers = {"X-Request-Id": self.request_id}
        self.decision: Decision | None = None
        self.status = 500
        self.kind = OutcomeKind.FAILED
        self.error_code: str | None = None
        # The request's trace ids, when tracing is on: its arms' spans are drawn under
        # them, and an upstream that takes the trace context is told of them.
        spans = state.spans
        self.trace = (
            None
            if spans is None
            else tracing.request_ids(
                request.headers.get("traceparent"),
                request.headers.get("tracestate"),
                spans.settings.ratio,
                spans.settings.parent_based,
            )
        )

    async def serve(self) -> web.StreamResponse:
        traced = None if self.trace is None else tracing.begin(self.trace)
        try:
            return await self._serve()
        except ProxyError as error:
            self.status, self.error_code = error.status, error.code
            # 429 and 5xx: nobody could answer; any other 4xx, or the caller's own limits:
            # the request was refused.
            self.kind = (
                OutcomeKind.FAILED
                if error.status >= 500 or (error.status == 429 and not isinstance(error, OverLimit))
                else OutcomeKind.REJECTED
            )
            response = error.response(self.headers)
            if error.close_connection:
                await answer_and_close(self.request, response)
            return response
        except asyncio.CancelledError:
            self.status, self.kind = CLIENT_GONE, OutcomeKind.CANCELLED
            raise
        finally:
            if traced is not None:
                tracing.end(traced)
            self.emit()

    async def _serve(self) -> web.StreamResponse:
        state = self.state
        # Who is calling, before anything of the request is read or said about the roles.
        subject = await state.access.identify(self.request.headers.get(hdrs.AUTHORIZATION))
        state.access.may_use_some_role(subject)
        body = parse_body(await read_body(self.request, state.settings.max_body_bytes))
        header_role = readable(self.request.headers.get(ROLE_HEADER), ROLE_HEADER)
        granted = partial(state.access.roles_of, subject, self.config)
        role = choose_role(body, header_role, self.config, granted)
        admission = state.access.authorize(subject, role.name)
        if admission is None:
            # Word for word what a role that does not exist gets (wire/chat_request.py).
            raise unknown_role(granted, by_header=header_role is not None)
        self.headers["X-Rolegate-Role"] = role.name
        # From here on the outcome names the role and grant, even if the request is then
        # refused.
        self.decision = Decision(
            self.request_id,  # request_id
            role.name,  # role
            role.effective_ruling.value,  # ruling
            self.started,  # started_at
            body.get("stream") is True,  # stream
            role.patience_seconds,  # patience_seconds
            admission.grant.name,  # grant (positional: matching keywords costs more)
        )
        self.decision.trace = self.trace
        if admission.limited is not None:
            raise rate_limited(admission.limited)
        chat = validate_chat_request(body, role)
        if chat.caller.narrows_machines:
            # Only a caller's `only`/`ignore` can leave no machine: the role's machines are
            # gathered for those requests alone.
            refuse_unreachable(chat.caller, role, role_machines(role, self.config))
        response = await state.dispatcher.handle(
            self.request, chat, self.config, self.decision, self.headers
        )
        self.status, self.kind = response.status, OutcomeKind.ANSWERED
        if self.decision.outcome is OutcomeKind.CANCELLED:
            self.status = CLIENT_GONE
        return response

    def emit(self) -> None:
        """Exactly one outcome per request (SPEC C7): O(1), no I/O."""
        now = self.state.dispatcher.now()
        if self.decision is not None:
            outcome = self.decision.finish(
                outcome=self.kind, status=self.status, now=now, config_hash=self.config.hash,
                error_code=self.error_code,
            )  # fmt: skip
        else:
            outcome = Outcome(
                request_id=self.request_id,
                role=None,
                outcome=self.kind,
                status=self.status,
                stream=False,
                started_at=time.time() - (now - self.started),
                latency_seconds=now - self.started,
                config_hash=self.config.hash,
                error_code=self.error_code,
                trace=self.trace,
            )
        self.state.access.charge(outcome)
        # The access line is written from this record too (access_log.py), off this path.
        self.state.outcomes.emit(outcome)


def request_id(request: web.Request) -> str:
    """The caller's X-Request-Id when it is a sane token (it is echoed and logged), else a
    fresh one."""
    given = request.headers.get("X-Request-Id", "")
    if 0 < len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given:
        return given
    return f"{_ids.getrandbits(128):032x}"


# Request ids: 128 random bits, as a UUID4 carries, from a generator seeded once from the OS
# (uuid4 reads the OS's randomness and builds a UUID object for every request). An id is a
# label to find a request by, never a secret.
_ids = random.Random(os.urandom(32))


def body_too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"Request body is over the {limit}-byte limit; send a smaller request "
        "or raise the proxy's --max-body-bytes.",
        code="body_too_large",
    )


class BodyTimedOut(web.HTTPRequestTimeout):
    """A request body that did not arrive within the body limit: what reading it raises
    (set on the body by the connection handler, edge/connections.py). An HTTP error, so that
    a handler that lets it through still answers 408 in our shape (edge/error_shape.py)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds


def body_timed_out(seconds: float) -> ProxyError:
    return ProxyError(
        408,
        f"The request body did not arrive within {seconds:g} s of its headers; send the "
        "whole body at once, or raise the proxy's --body-timeout-seconds.",
        code="body_timeout",
        close_connection=True,
    )


# The content codings aiohttp decodes (br and zstd only with their libraries installed: the
# parser refuses them otherwise), and the one that means none.
DECODED_CODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})


def unsupported_encoding() -> ProxyError:
    """A Content-Encoding the proxy cannot decode: 415, naming the codings it can (RFC 9110
    15.5.16). Without this refusal aiohttp would read an unknown coding's bytes as they
    came, and the body would fail as JSON for a reason the client cannot see."""
    return ProxyError(
        415,
        "The request's Content-Encoding is not one the proxy decodes; send the body "
        "uncompressed, or compressed with gzip or deflate, and say so in Content-Encoding.",
        code="unsupported_encoding",
        headers={hdrs.ACCEPT_ENCODING: "gzip, deflate"},
    )


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    coding = request.headers.get(hdrs.CONTENT_ENCODING) or "identity"
    if coding.lower() not in DECODED_CODINGS:
        raise unsupported_encoding()
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    except BodyTimedOut as late:
        raise body_timed_out(late.seconds) from None
    except (web.RequestPayloadError, ValueError) as exc:
        raise unreadable_body(exc) from None


def unreadable_body(exc: Exception) -> ProxyError:
    """A body cut short, badly chunked, or not decoding as its Content-Encoding says. aiohttp
    keeps the parser's own error as the cause of the one the read raises."""
    if isinstance(exc.__cause__, http_exceptions.ContentEncodingError):
        message = (
            "The request body does not decode as its Content-Encoding header says; send "
            "it uncompressed, or compressed as declared (gzip or deflate)."
        )
        code = "invalid_encoding"
    else:
        message = (
            "The request body could not be read: it is cut short or its chunked framing is "
            "broken; send the whole body, with a Content-Length that matches it or as "
            "well-formed chunks."
        )
        code = "invalid_body_framing"
    return ProxyError(400, message, code=code, close_connection=True)


async def answer_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Send `response` at once, then close the connection. After a broken body nothing
    more on the connection can be read: aiohttp, left to itself, would try to drain the
    rest after the answer (and log the read's error). Closing it before the answer was
    sent would lose the answer."""
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write_eof()
    request.protocol.force_close()
