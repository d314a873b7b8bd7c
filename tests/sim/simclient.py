"""Small clients for the simulator tests: scenario builders, an SSE parser, and a raw HTTP/1.1
exchange over a plain socket for the tests that care about individual network reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from openai.types.chat import ChatCompletionMessageParam

from rolegate_sim.server import RunningSim

from ..waiting import eventually

# The `start_sim` fixture: start a simulator for this scenario dict, stopped after the test.
StartSim = Callable[[dict[str, Any]], Awaitable[RunningSim]]

MODEL = "vendor/model-a"
REPLY = "one two three four five six"  # six tokens
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def machine(name: str, *faults: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ttftSeconds": 0,
        "tokensPerSecond": 0,
        **settings,
        "faults": list(faults),
    }


def scenario(
    *machines: dict[str, Any],
    reply: str = REPLY,
    model_fields: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """One model served by `machines`; `model_fields` adds to the model (reasoning, ...)."""
    model = {"name": MODEL, "reply": reply, **(model_fields or {}), "machines": list(machines)}
    return {"seed": 7, **top, "models": [model]}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw)

    @property
    def events(self) -> list[Any]:
        return parse_sse(self.raw)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "choices" in e]

    @property
    def deltas(self) -> list[dict[str, Any]]:
        """The `delta` of every chunk that has one (the usage chunk has no choices)."""
        return [choice["delta"] for chunk in self.chunks for choice in chunk["choices"]]

    @property
    def reasoning(self) -> str:
        """The streamed reasoning, in whichever of the two fields it came."""
        return "".join(
            delta.get("reasoning_content") or delta.get("reasoning") or "" for delta in self.deltas
        )

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The streamed tool calls put together by `index`, as agents do: the id and name
        from a call's first event, the arguments from every event's fragment in order."""
        calls: dict[int, dict[str, Any]] = {}
        for delta in self.deltas:
            for part in delta.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"id": None, "name": None, "arguments": ""})
                function = part.get("function", {})
                if "id" in part:
                    call["id"] = part["id"]
                if "name" in function:
                    call["name"] = function["name"]
                call["arguments"] += function.get("arguments", "")
        return [calls[index] for index in sorted(calls)]

    @property
    def finish_reason(self) -> str | None:
        """The stream's finish reason; None when it never finished."""
        reasons = [
            chunk["choices"][0]["finish_reason"] for chunk in self.chunks if chunk["choices"]
        ]
        return next((reason for reason in reasons if reason is not None), None)

    @property
    def text(self) -> str:
        return "".join(
            choice["delta"].get("content") or ""
            for chunk in self.chunks
            for choice in chunk["choices"]
        )


def parse_sse(raw: bytes) -> list[Any]:
    """`data:` payloads in order; JSON decoded, `[DONE]` kept as the string."""
    events: list[Any] = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines), block
        # The lines of one event join with a newline (the SSE rule).
        data = "\n".join(line[len("data: ") :] for line in lines)
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def chat(session: aiohttp.ClientSession, url: str, payload: Any, **kwargs: Any) -> Reply:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with session.post(
        f"{url}/v1/chat/completions",
        data=data,
        headers={"Content-Type": "application/json"},
        **kwargs,
    ) as response:
        raw = await response.read()
        return Reply(response.status, dict(response.headers), raw)


async def records(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/_sim/requests") as response:
        assert response.status == 200
        result: list[dict[str, Any]] = await response.json()
        return result


async def finished_record(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The latest record once its outcome is final (the handler may still be unwinding)."""

    async def finished() -> dict[str, Any] | None:
        latest = (await records(session, url))[-1]
        return latest if latest["outcome"] != "in_progress" else None

    return await eventually(finished, what="the latest simulator record to finish")


@dataclass
class RawExchange:
    reads: list[bytes] = field(default_factory=list)
    reset: bool = False

    @property
    def raw(self) -> bytes:
        return b"".join(self.reads)

    def head_and_body(self) -> tuple[str, bytes]:
        head, _, rest = self.raw.partition(b"\r\n\r\n")
        return head.decode("latin-1"), rest

    @property
    def status(self) -> int:
        return int(self.head_and_body()[0].split(" ", 2)[1])

    def _segments(self) -> list[tuple[int, int]]:
        """(raw offset, length) of every body byte run, HTTP chunk framing excluded."""
        raw = self.raw
        position = raw.index(b"\r\n\r\n") + 4
        if b"transfer-encoding: chunked" not in raw[:position].lower():
            return [(position, len(raw) - position)]
        segments: list[tuple[int, int]] = []
        while position < len(raw):
            line_end = raw.index(b"\r\n", position)
            size = int(raw[position:line_end], 16)
            if size == 0:
                break
            segments.append((line_end + 2, size))
            assert raw[line_end + 2 + size : line_end + 4 + size] == b"\r\n"
            position = line_end + 4 + size
        return segments

    def chunks(self) -> list[bytes]:
        """The body's HTTP/1.1 chunks (one per server write), framing removed."""
        return [self.raw[start : start + size] for start, size in self._segments()]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks())

    def read_boundaries_inside_characters(self) -> int:
        """How many network reads ended in the middle of a multi-byte UTF-8 character of
        the body: the body byte right after the read's end is a continuation byte."""
        segments = self._segments()
        body = self.body
        count, boundary = 0, 0
        for read in self.reads[:-1]:
            boundary += len(read)
            before = sum(min(max(boundary - start, 0), size) for start, size in segments)
            if 0 < before < len(body) and 0x80 <= body[before] <= 0xBF:
                count += 1
        return count


async def raw_post(port: int, payload: dict[str, Any]) -> RawExchange:
    """POST over a bare socket with `Connection: close`, keeping every read separately."""
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    exchange = RawExchange()
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        await writer.drain()
        async with asyncio.timeout(5):
            while True:
                try:
                    read = await reader.read(65536)
                except ConnectionResetError:
                    exchange.reset = True
                    break
                if not read:
                    break
                exchange.reads.append(read)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return exchange
