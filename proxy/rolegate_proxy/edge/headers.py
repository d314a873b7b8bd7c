"""A caller's request headers as text, or a 400/401 saying the header is not text.

aiohttp decodes header bytes as UTF-8 with `surrogateescape`: a byte that is not UTF-8
arrives as a lone surrogate, and the first `.encode()` of the value (hashing a credential,
writing an answer or a log line that holds it) raises, which the server answers with a
500 and a traceback. So every header the proxy takes a decision on passes `readable` first:
`Authorization` (edge/callers.py) and `X-Rolegate-Role` (edge/calls.py).

Headers read only to be copied or correlated by (`X-Request-Id`, `traceparent`,
`tracestate`) are never refused: one that is not a sane ASCII token is ignored where it is
read (edge/calls.py `request_id`, core/trace_ids.py), as W3C Trace Context asks of a
malformed trace header, so a tracing header can never fail a request.

The answers name the header (our constant) and never repeat its value.
"""

from __future__ import annotations

from aiohttp import hdrs

from ..wire.errors import ProxyError


def readable(value: str | None, name: str) -> str | None:
    """`value` (the header `name` as aiohttp decoded it, None when absent) when it is
    text; raises `unreadable` otherwise."""
    if value is None or value.isascii():  # every header a client normally sends
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate: a byte of the header was not UTF-8
        raise unreadable(name) from None
    return value


def unreadable(name: str) -> ProxyError:
    """401 for `Authorization` (the client's credential is at fault, and clients treat a
    401 as such), 400 for any other header."""
    if name == hdrs.AUTHORIZATION:
        return ProxyError(
            401,
            "The Authorization header holds bytes that are not UTF-8 text; send "
            "`Bearer <credential>` with the ServiceAccount token or API key exactly as "
            "issued (both are plain ASCII).",
            error_type="authentication_error",
            code="invalid_api_key",
        )
    return ProxyError(
        400,
        f"The {name} header holds bytes that are not UTF-8 text; send it as plain ASCII.",
        code="invalid_header",
        param=name,
    )
