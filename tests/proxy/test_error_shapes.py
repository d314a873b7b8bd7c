"""Every error the proxy can answer, from any path, is in the OpenAI error shape (SPEC E2).

test_errors.py covers the chat endpoint's own checks of its body; here: what aiohttp answers
around the handlers (an unknown path, a wrong method, a body too large for another route),
what its HTTP parser refuses (sent over a raw socket: no client would send it), bodies that
cannot be decoded or nest too deep, a handler that crashes, and a few hundred generated bad
requests. Each answer says what to fix, echoes none of the request's text, and leaves the
proxy serving.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import random
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from rolegate_proxy.edge import app as proxy_app

from ..support import ProxyFactory, SimFactory, one_machine_sim, provider_policy, role, role_table

MODEL = "vendor/model-a"
GOOD = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
CHAT = "/v1/chat/completions"
ADMIN_TOKEN = "admin-secret"
LIMIT = 64 * 1024
# Planted in bad requests: an answer or a log line that holds it echoed the request.
MARKER = "zq7marker"


@pytest.fixture
async def proxy_url(sim_server: SimFactory, proxy_server: ProxyFactory) -> str:
    sim = await one_machine_sim(sim_server, MODEL, reply="one two three", tokens_per_second=500)
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        max_body_bytes=LIMIT,
        admin_token=ADMIN_TOKEN,
    )
    return proxy.url


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


def _openai_error(answer: Answer, status: int) -> dict[str, Any]:
    """The answer's `error`, once it is `status` in the OpenAI shape, echoing no marker."""
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    document = json.loads(answer.body)
    assert set(document) == {"error"}, document
    error: dict[str, Any] = document["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str), error
    assert error["message"], error
    assert isinstance(error["type"], str), error
    assert error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert MARKER not in answer.body.decode("utf-8"), error
    return error


async def _send(
    proxy_url: str, method: str, path: str, content: bytes = b"", **headers: str
) -> Answer:
    async with httpx.AsyncClient() as client:
        response = await client.request(
            method, f"{proxy_url}{path}", content=content, headers=headers
        )
    return Answer(response.status_code, dict(response.headers), response.content)


async def _raw(proxy_url: str, request: bytes, *, within: float = 10.0) -> Answer:
    """`request` as bytes on a fresh connection: the answer, read until the proxy closes."""
    address = urlsplit(proxy_url)
    assert address.hostname is not None
    assert address.port is not None
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(request)
        await writer.drain()
        received = await asyncio.wait_for(reader.read(), within)
    finally:
        writer.close()
    assert received, "the proxy closed the connection without an answer"
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, body)


async def _still_serving(proxy_url: str) -> None:
    """A normal request still goes through the simulator and back."""
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{proxy_url}{CHAT}", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


# --- around the handlers: routing and the body limit ---------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/{MARKER}"),
        ("POST", f"/v1/{MARKER}/completions"),
        ("GET", "/"),
        ("GET", "/v1/models/"),
        ("POST", "/v1/chat/completions/extra"),
        ("GET", f"/v1/%00{MARKER}"),
    ],
)
async def test_an_unknown_path_is_404_naming_the_endpoints(
    proxy_url: str, method: str, path: str
) -> None:
    error = _openai_error(await _send(proxy_url, method, path), 404)
    assert error["code"] == "unknown_url"
    assert "POST /v1/chat/completions" in error["message"]
    assert "GET /v1/models" in error["message"]
    # aiohttp's HEAD twin of each GET route is no endpoint worth naming.
    assert "HEAD" not in error["message"]
    await _still_serving(proxy_url)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", CHAT, "POST"),
        ("PUT", CHAT, "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("POST", "/healthz", "GET, HEAD"),
    ],
)
async def test_a_wrong_method_is_405_naming_the_allowed_ones(
    proxy_url: str, method: str, path: str, allowed: str
) -> None:
    answer = await _send(proxy_url, method, path)
    error = _openai_error(answer, 405)
    assert error["code"] == "method_not_allowed"
    assert f"it accepts {allowed}." in error["message"]
    assert "POST /v1/chat/completions" in error["message"]
    assert answer.headers["allow"] == allowed.replace(" ", "")
    await _still_serving(proxy_url)


async def test_a_method_no_route_takes_is_405_and_not_echoed(proxy_url: str) -> None:
    error = _openai_error(await _send(proxy_url, "PROPFIND", CHAT), 405)
    assert "PROPFIND" not in error["message"]


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversized_body_on_another_route_is_413(proxy_url: str, chunked: bool) -> None:
    big = b'{"request_id": "' + b"x" * (LIMIT + 10) + b'"}'

    async def chunks() -> Any:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy_url}/v1/feedback",
            content=chunks() if chunked else big,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    answer = Answer(response.status_code, dict(response.headers), response.content)
    error = _openai_error(answer, 413)
    assert error["code"] == "body_too_large"
    assert f"{LIMIT}-byte limit" in error["message"]
    await _still_serving(proxy_url)


async def test_answers_that_are_no_errors_pass_untouched(proxy_url: str) -> None:
    metrics = await _send(proxy_url, "GET", "/metrics")
    assert metrics.status == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    models = await _send(proxy_url, "GET", "/v1/models")
    assert models.status == 200
    assert json.loads(models.body)["object"] == "list"


# --- what the HTTP parser refuses ------------------------------------------------------------

HOST = b"Host: x\r\n"
POST_HEAD = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n".encode()
CHUNKED_POST = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
MARK = MARKER.encode()

TOO_MANY = b"".join(b"X-%d: %s\r\n" % (i, MARK) for i in range(200))
# (what is wrong, the request, the error code, what the message says to fix)
PARSER_ERRORS: list[tuple[str, bytes, str, str]] = [
    ("no method", b"HELLO " + MARK + b"\r\n\r\n", "invalid_request_line", "HTTP method"),
    (
        "an unknown method",
        b"X" + MARK.upper() + b" /v1/models HTTP/1.1\r\n" + HOST + b"\r\n",
        "invalid_request_line",
        "HTTP method",
    ),
    (
        "a bad character in the method",
        b"G(T /" + MARK + b" HTTP/1.1\r\n" + HOST + b"\r\n",
        "invalid_request_line",
        "HTTP method",
    ),
    (
        "an unknown HTTP version",
        b"GET /" + MARK + b" HTTP/9\r\n" + HOST + b"\r\n",
        "invalid_request_line",
        "METHOD /path HTTP/1.1",
    ),
    (
        "TLS to the plain-HTTP port",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + MARK,
        "invalid_request_line",
        "HTTPS",
    ),
    (
        "a space in a header name",
        b"GET /healthz HTTP/1.1\r\nBad " + MARK + b": x\r\n" + HOST + b"\r\n",
        "invalid_http",
        "`Name: value`",
    ),
    (
        "a header line without a colon",
        b"GET /healthz HTTP/1.1\r\n" + MARK + b"\r\n" + HOST + b"\r\n",
        "invalid_http",
        "`Name: value`",
    ),
    (
        "a header too large",
        b"GET /healthz HTTP/1.1\r\nX-Big: " + MARK * 1000 + b"\r\n" + HOST + b"\r\n",
        "header_too_large",
        "shorten the URL or the headers",
    ),
    (
        "a URL too long",
        b"GET /" + MARK * 1000 + b" HTTP/1.1\r\n" + HOST + b"\r\n",
        "header_too_large",
        "shorten the URL or the headers",
    ),
    (
        "too many headers",
        b"GET /healthz HTTP/1.1\r\n" + TOO_MANY + HOST + b"\r\n",
        "invalid_http",
        "not too many",
    ),
    ("no Host header", b"GET /healthz HTTP/1.1\r\n\r\n", "invalid_http", "a Host header"),
    (
        "a chunk size that is not hex",
        CHUNKED_POST + b"zz\r\n" + MARK + b"\r\n0\r\n\r\n",
        "invalid_http",
        "well-formed chunks",
    ),
    (
        "a chunk longer than its size",
        CHUNKED_POST + b"4\r\n" + MARK + b"\r\n0\r\n\r\n",
        "invalid_http",
        "well-formed chunks",
    ),
    (
        "both Content-Length and chunked",
        POST_HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "invalid_http",
        "never both",
    ),
    (
        "two Content-Lengths",
        POST_HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "invalid_http",
        "matching Content-Length",
    ),
]


@pytest.mark.parametrize(
    ("sent", "code", "says"),
    [pytest.param(sent, code, says, id=what) for what, sent, code, says in PARSER_ERRORS],
)
async def test_what_the_parser_refuses_is_400_in_the_openai_shape(
    proxy_url: str, sent: bytes, code: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    error = _openai_error(await _raw(proxy_url, sent), 400)
    assert error["code"] == code
    assert says in error["message"]
    # Logged as the client's mistake: no traceback, and none of the request's bytes.
    logged = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert logged, [r.getMessage() for r in caplog.records]
    assert all(r.exc_info is None and MARKER not in r.getMessage() for r in logged)
    await _still_serving(proxy_url)


# --- bodies that cannot be read --------------------------------------------------------------


async def test_a_body_that_is_not_what_its_content_encoding_says_is_400(proxy_url: str) -> None:
    body = json.dumps(GOOD).encode()
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answer = await _raw(proxy_url, request)
    error = _openai_error(answer, 400)
    assert error["code"] == "invalid_encoding"
    assert "does not decode as its Content-Encoding" in error["message"]
    # The rest of the stream is unreadable: the answer says the connection closes.
    assert answer.headers["connection"] == "close"
    await _still_serving(proxy_url)


@pytest.mark.parametrize("coding", ["br2", "gzip, gzip", "x-gzip", "compress"])
async def test_a_content_encoding_the_proxy_cannot_decode_is_415(
    proxy_url: str, coding: str
) -> None:
    answer = await _send(
        proxy_url, "POST", CHAT, json.dumps(GOOD).encode(), **{"Content-Encoding": coding}
    )
    error = _openai_error(answer, 415)
    assert error["code"] == "unsupported_encoding"
    assert "gzip or deflate" in error["message"]
    assert answer.headers["accept-encoding"] == "gzip, deflate"
    await _still_serving(proxy_url)


async def test_a_gzipped_body_is_still_served(proxy_url: str) -> None:
    answer = await _send(
        proxy_url,
        "POST",
        CHAT,
        gzip.compress(json.dumps(GOOD).encode()),
        **{"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert answer.status == 200, answer


async def test_a_body_that_decompresses_past_the_limit_is_413(proxy_url: str) -> None:
    bomb = gzip.compress(b'{"model": "agent", "x": "' + b"0" * 10_000_000 + b'"}')
    assert len(bomb) < LIMIT
    answer = await _send(proxy_url, "POST", CHAT, bomb, **{"Content-Encoding": "gzip"})
    error = _openai_error(answer, 413)
    assert error["code"] == "body_too_large"
    await _still_serving(proxy_url)


def _nested_content(depth: int) -> bytes:
    content = "[" * depth + "]" * depth
    return f'{{"model": "agent", "messages": [{{"role": "user", "content": {content}}}]}}'.encode()


# 300: past what orjson writes (the body could not be sent upstream); 2000: past what
# orjson even reads.
@pytest.mark.parametrize("depth", [300, 1000, 2000])
async def test_json_nested_too_deep_is_400_saying_so(proxy_url: str, depth: int) -> None:
    error = _openai_error(await _send(proxy_url, "POST", CHAT, _nested_content(depth)), 400)
    assert error["code"] == "invalid_body"
    assert "nested more than 254 levels deep" in error["message"]
    await _still_serving(proxy_url)


async def test_json_nested_within_the_limit_is_served(proxy_url: str) -> None:
    answer = await _send(proxy_url, "POST", CHAT, _nested_content(100))
    assert answer.status == 200, answer


# --- a handler that fails --------------------------------------------------------------------


class _Crashing:
    def __init__(self, *_: object) -> None:
        pass

    async def serve(self) -> None:
        raise RuntimeError("a bug in the handler")


async def test_a_crashing_handler_is_500_in_the_openai_shape(
    proxy_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(proxy_app, "Call", _Crashing)
    body = json.dumps({**GOOD, "messages": [{"role": "user", "content": MARKER}]}).encode()
    error = _openai_error(await _send(proxy_url, "POST", CHAT, body), 500)
    assert error["type"] == "server_error"
    assert error["code"] == "internal_error"
    assert "a bug in rolegate" in error["message"]
    assert "a bug in the handler" not in error["message"]
    # aiohttp logged the traceback, as for any handler that raises; the body stays out.
    (logged,) = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert logged.levelno == logging.ERROR
    assert logged.exc_info is not None
    assert MARKER not in caplog.text
    # That error was this test's purpose: the autouse `no_server_errors` is not to fail on it.
    caplog.clear()
    monkeypatch.undo()
    await _still_serving(proxy_url)


# --- generated bad requests ------------------------------------------------------------------


def _any_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "big", "float", "str", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:6])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-(2**31), 2**31)
    if kind == "big":
        return rng.choice([2**64, -(2**63) - 1, 10**40])
    if kind == "float":
        return rng.choice([0.5, -1e308, 1e-300, 3.25])
    if kind == "str":
        return rng.choice(["", "x", "agent ", "\u00e9\u4e2d\U0001f600", "\ud800", "\x00", MARKER])
    if kind == "list":
        return [_any_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "role", "", MARKER]): _any_json(rng, depth + 1) for _ in range(2)}


def _not(rng: random.Random, *types: type) -> Any:
    """Any JSON value but one of `types` (bool is no int here: JSON tells them apart)."""
    while True:
        value = _any_json(rng)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return value


def _bad_body(rng: random.Random) -> dict[str, Any]:
    """A chat body the proxy must refuse: one field wrong, other fields anything."""
    body: dict[str, Any] = {
        "model": "agent",
        "messages": [{"role": "user", "content": _any_json(rng)}],
        rng.choice(["temperature", "tools", "n", MARKER]): _any_json(rng),
    }
    field = rng.choice(["model", "messages", "message", "stream", "stream_options"])
    if field == "model":
        body["model"] = rng.choice([_not(rng, str), "", "no-such-role"])
    elif field == "messages":
        body["messages"] = rng.choice([_not(rng, list), []])
    elif field == "message":
        body["messages"].append(
            rng.choice([_not(rng, dict), {"content": "x"}, {"role": _not(rng, str)}])
        )
    elif field == "stream":
        body["stream"] = _not(rng, bool)
    else:
        body["stream_options"] = _not(rng, dict, type(None))
    return body


def _bad_request(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers) of a request the proxy must refuse with a 4xx."""
    content_type = rng.choice(
        ["application/json", "text/plain", "application/x-www-form-urlencoded",
         "multipart/form-data; boundary=x", None]
    )  # fmt: skip
    headers = {"Content-Type": content_type} if content_type else {}
    good = json.dumps(GOOD).encode()
    shape = rng.choice(
        ["field", "field", "field", "top", "cut", "bytes", "latin1", "coding", "route"]
    )
    if shape == "field":
        body = json.dumps(_bad_body(rng)).encode()
    elif shape == "top":
        body = json.dumps(_not(rng, dict)).encode()
    elif shape == "cut":
        body = good[: rng.randrange(len(good))]
    elif shape == "bytes":
        body = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + b"\xff"
    elif shape == "latin1":
        body = json.dumps({**GOOD, "user": MARKER + "\u00e9"}, ensure_ascii=False).encode("latin-1")
    elif shape == "coding":
        headers["Content-Encoding"] = rng.choice(["br2", "gzip, gzip", "x-gzip", "*", MARKER])
        body = good
    else:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
        path = rng.choice([CHAT, "/v1/completions", f"/{MARKER}", "/v1/models/x", "/v2"])
        return method, path, good, headers
    return "POST", CHAT, body, headers


async def test_generated_bad_requests_all_get_a_4xx_in_the_openai_shape(proxy_url: str) -> None:
    rng = random.Random(12)
    requests = [_bad_request(rng) for _ in range(400)]
    gate = asyncio.Semaphore(16)
    failures: list[str] = []

    async def one(client: httpx.AsyncClient, method: str, path: str, body: bytes,
                  headers: dict[str, str]) -> None:  # fmt: skip
        async with gate:
            response = await client.request(
                method, f"{proxy_url}{path}", content=body, headers=headers
            )
        answer = Answer(response.status_code, dict(response.headers), response.content)
        try:
            assert 400 <= answer.status < 500, answer
            _openai_error(answer, answer.status)
        except AssertionError as failure:
            failures.append(f"{method} {path} {body[:120]!r}: {failure}")

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(client, *request) for request in requests))
    assert not failures, "\n".join(failures[:10])
    await _still_serving(proxy_url)
