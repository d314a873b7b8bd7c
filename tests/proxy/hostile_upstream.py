"""An upstream that answers with hostile sizes, run as its own process (so none of its work
is on the test's event loop, which the proxy under test shares).

    python tests/proxy/hostile_upstream.py [--port N]   # prints its port, serves until killed

What it answers is chosen by the request's model, `hostile/<kind>`:
- `gzip-bomb`: a stream, gzip-encoded, whose first event is 200 MB of one letter (about
  200 KB on the wire, 1,000 to 1);
- `big-event`: a stream whose first event is 50 MB;
- `big-event-later`: a stream that says "Hello " and then sends a 50 MB event;
- `big-body`: a 200 MB non-streamed answer, chunked (no length announced);
- `announced-body`: a non-streamed answer whose Content-Length says 200 MB;
- `gzip-body-bomb`: a non-streamed answer, gzip-encoded, 200 MB of one letter inside.
Every answer it sends is counted at `GET /sent` (the bytes it wrote, per kind).
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from collections import Counter
from collections.abc import Iterator

from aiohttp import web

MB = 1024 * 1024
BLOCK = MB
_SENT: Counter[str] = Counter()


def _gzip(head: bytes, letters: int, tail: bytes) -> Iterator[bytes]:
    """`head`, then `letters` times the letter a, then `tail`, gzip-encoded as it goes."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    yield packer.compress(head)
    block = b"a" * BLOCK
    for _ in range(letters // BLOCK):
        if out := packer.compress(block):
            yield out
    yield packer.compress(tail) + packer.flush()


def _event_head() -> bytes:
    return (
        b'data: {"id":"h","object":"chat.completion.chunk",'
        b'"choices":[{"index":0,"delta":{"content":"'
    )


_EVENT_TAIL = b'"},"finish_reason":null}]}\n\n'
_BODY_HEAD = (
    b'{"id":"h","object":"chat.completion",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"'
)
_BODY_TAIL = b'"},"finish_reason":"stop"}]}'


async def _write_all(response: web.StreamResponse, kind: str, parts: Iterator[bytes]) -> None:
    try:
        for part in parts:
            await response.write(part)
            _SENT[kind] += len(part)
    except (ConnectionResetError, ConnectionError):
        return  # the proxy refused the answer and closed: what it should do


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    kind = str(body.get("model", "")).removeprefix("hostile/")
    streamed = bool(body.get("stream"))
    headers = {"Content-Type": "text/event-stream" if streamed else "application/json"}
    if kind in ("gzip-bomb", "gzip-body-bomb"):
        headers["Content-Encoding"] = "gzip"
    if kind == "announced-body":
        headers["Content-Length"] = str(200 * MB)
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    if kind == "gzip-bomb":
        parts = _gzip(_event_head(), 200 * MB, _EVENT_TAIL)
    elif kind == "gzip-body-bomb":
        parts = _gzip(_BODY_HEAD, 200 * MB, _BODY_TAIL)
    elif kind in ("big-event", "big-event-later"):
        hello = _event_head() + b"Hello " + _EVENT_TAIL if kind == "big-event-later" else b""
        parts = iter([hello + _event_head(), *[b"a" * BLOCK] * 50, _EVENT_TAIL])
    else:  # big-body, announced-body
        parts = iter([_BODY_HEAD, *[b"a" * BLOCK] * 200, _BODY_TAIL])
    await _write_all(response, kind, parts)
    return response


async def sent(_: web.Request) -> web.Response:
    return web.json_response(dict(_SENT))


async def main(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/sent", sent)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"port": port}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(int(sys.argv[2]) if sys.argv[1:2] == ["--port"] else 0))
    except KeyboardInterrupt:
        sys.exit(0)
