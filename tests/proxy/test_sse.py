"""The byte-level event framer: a character split across reads must survive (SPEC A1), and
each event is handed out as where its bytes lie in the framer's buffer, one at a time."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolegate_proxy.wire.sse import (
    EventFramer,
    EventTooLarge,
    Kind,
    MalformedEvent,
    decode_event_json,
)

TEXT = "em dash — café naïve 日本語のテキスト 🚀 done"

# (what a data event reads as, or the kind of a comment or [DONE]; its bytes)
Seen = tuple[bytes | Kind, bytes]


def _stream(*payloads: dict[str, object]) -> bytes:
    out = b""
    for payload in payloads:
        out += b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _as_is(data: bytes) -> bytes:
    return data


def _unexpected() -> None:
    raise AssertionError("no event is malformed here")


def _events(
    framer: EventFramer,
    read: Callable[[bytes], bytes] = _as_is,
    on_malformed: Callable[[], None] = _unexpected,
) -> list[Seen]:
    """Every event the framer hands out now, its bytes cut from the buffer at its span."""
    return [
        (value, buffer[start:end])
        for value, buffer, start, end in framer.events(read, on_malformed)
    ]


def _fed(framer: EventFramer, data: bytes) -> list[Seen]:
    framer.feed(data)
    return _events(framer)


def _reference(stream: bytes) -> list[Seen]:
    """What the framer must find in a whole stream, by the plainest reading of the format:
    blocks at blank lines, `data` lines joined, comments, other fields ignored."""
    normalized = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    seen: list[Seen] = []
    start = 0
    while (end := normalized.find(b"\n\n", start)) >= 0:
        block, start = normalized[start:end], end + 2
        lines = [line for line in block.split(b"\n") if line]
        data = [
            value[1:] if value.startswith(b" ") else value
            for field, _, value in (line.partition(b":") for line in lines)
            if field == b"data"
        ]
        if data:
            joined = b"\n".join(data)
            seen.append((Kind.DONE if joined.strip() == b"[DONE]" else joined, block + b"\n\n"))
        elif any(line.startswith(b":") for line in lines):
            seen.append((Kind.COMMENT, block + b"\n\n"))
    return seen


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64])
def test_every_split_position_reassembles_exactly(piece: int) -> None:
    events: list[dict[str, object]] = [{"c": word} for word in TEXT.split(" ")]
    raw = _stream(*events)
    framer = EventFramer()
    seen: list[Seen] = []
    for start in range(0, len(raw), piece):
        seen += _fed(framer, raw[start : start + piece])
    assert seen[-1] == (Kind.DONE, b"data: [DONE]\n\n")
    assert framer.pending == b""
    datas = [data for data, _ in seen[:-1] if isinstance(data, bytes)]
    assert len(datas) == len(seen) - 1
    assert "".join(json.loads(data)["c"] for data in datas) == "".join(TEXT.split(" "))
    # Each event's span is its own bytes, whatever reads it arrived in.
    assert b"".join(raw_bytes for _, raw_bytes in seen) == raw


def test_a_split_multibyte_character_waits_for_its_second_half() -> None:
    event = 'data: {"c": "—"}\n\n'.encode()
    cut = event.index("—".encode()) + 1  # inside the three bytes of the em dash
    framer = EventFramer()
    assert not framer.feed(event[:cut])
    assert _events(framer) == []
    ((data, whole),) = _fed(framer, event[cut:])
    assert isinstance(data, bytes)
    assert decode_event_json(data) == {"c": "—"}
    assert whole == event


def test_crlf_line_endings_and_a_cr_split_from_its_lf() -> None:
    raw = b'data: {"c": "a"}\r\n\r\ndata: {"c": "b"}\r\n\r\n'
    framer = EventFramer()
    split = raw.index(b"\r\n\r\n") + 1
    seen = _fed(framer, raw[:split]) + _fed(framer, raw[split:])
    assert [json.loads(data)["c"] for data, _ in seen if isinstance(data, bytes)] == ["a", "b"]
    # Forwarded with its line endings normalised.
    assert [raw_bytes for _, raw_bytes in seen] == [
        b'data: {"c": "a"}\n\n',
        b'data: {"c": "b"}\n\n',
    ]


def test_comments_are_events_of_their_own_and_fields_other_than_data_are_ignored() -> None:
    seen = _fed(EventFramer(), b': OPENROUTER PROCESSING\n\nevent: x\nid: 1\ndata: {"c": 1}\n\n')
    assert seen == [
        (Kind.COMMENT, b": OPENROUTER PROCESSING\n\n"),
        (b'{"c": 1}', b'event: x\nid: 1\ndata: {"c": 1}\n\n'),
    ]


def test_a_block_without_data_is_no_event_and_its_bytes_are_in_no_span() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: {}\n\nid: 7\n\ndata: []\n\n")
    (_, first, start1, end1), (_, second, start2, end2) = framer.events(_as_is, _unexpected)
    assert first is second  # one read, one buffer: what a write forwards is cut from it
    assert first[start1:end1] == b"data: {}\n\n"
    assert first[start2:end2] == b"data: []\n\n"
    assert first[end1:start2] == b"id: 7\n\n"  # a gap: those bytes are not forwarded


def test_multi_line_data_is_joined_with_newlines() -> None:
    ((data, _),) = _fed(EventFramer(), b'data: {"c":\ndata: 2}\n\n')
    assert isinstance(data, bytes)
    assert decode_event_json(data) == {"c": 2}


@pytest.mark.parametrize(
    "event",
    [b"data: [DONE]\n\n", b"data:[DONE]\n\n", b"data:  [DONE] \n\n", b"data: [DONE]\r\n\r\n"],
)
def test_done_is_told_however_it_is_spaced(event: bytes) -> None:
    assert [value for value, _ in _fed(EventFramer(), event)] == [Kind.DONE]


def test_each_event_is_consumed_as_it_is_handed_out() -> None:
    """An iteration left unfinished (the relay stopped at the first content, say) leaves
    the rest for the next; a feed overtakes it."""
    framer = EventFramer()
    framer.feed(b"data: 1\n\ndata: 2\n\ndata: 3\n\n")
    events = framer.events(_as_is, _unexpected)
    assert next(events)[0] == b"1"
    assert [value for value, _ in _events(framer)] == [b"2", b"3"]
    assert list(events) == []

    framer.feed(b"data: 4\n\ndata: 5\n\n")
    unfinished = framer.events(_as_is, _unexpected)
    assert next(unfinished)[0] == b"4"
    assert framer.pending == b"data: 5\n\n"
    framer.feed(b"data: 6\n\n")
    assert list(unfinished) == []  # overtaken: what it had not handed out is the framer's
    assert [value for value, _ in _events(framer)] == [b"5", b"6"]


def test_an_unfinished_iteration_keeps_its_events_across_a_read_that_ends_none() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: 2\n\ndata: 3")
    events = framer.events(_as_is, _unexpected)
    assert next(events)[0] == b"1"
    # This read ends no event, but "2" waits whole: still worth handing out.
    assert framer.feed(b"4")
    assert [value for value, _ in _events(framer)] == [b"2"]
    assert not framer.feed(b"5")
    assert framer.feed(b"\n\n")
    assert [value for value, _ in _events(framer)] == [b"345"]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_an_event_is_refused_as_soon_as_it_grows_past_the_bound(ending: bytes) -> None:
    """Refused at the read that takes it past the bound, never after holding more: a 50 MB
    event costs a few reads, not 50 MB (SPEC E8)."""
    framer = EventFramer(max_event_bytes=1000)
    assert framer.feed(b"data: small" + ending + ending + b"data: " + b"x" * 94)
    assert [value for value, _ in _events(framer)] == [b"small"]
    for _ in range(8):
        framer.feed(b"x" * 100)  # 900 bytes held: within the bound
    with pytest.raises(EventTooLarge, match="1,000-byte bound"):
        framer.feed(b"x" * 101)


def test_an_event_at_the_bound_is_taken() -> None:
    framer = EventFramer(max_event_bytes=1000)
    event = b"data: " + b"x" * 992 + b"\n\n"
    for at in range(0, 1000, 100):
        framer.feed(event[at : at + 100])
    assert [value for value, _ in _events(framer)] == [b"x" * 992]


def test_an_event_its_reader_finds_malformed_is_skipped_and_told() -> None:
    def read(data: bytes) -> bytes:
        decode_event_json(data)
        return data

    told: list[None] = []
    framer = EventFramer()
    framer.feed(b'data: {"a": 1}\n\ndata: {oops\n\ndata: {"b": 2}\n\n')
    seen = _events(framer, read, lambda: told.append(None))
    assert [value for value, _ in seen] == [b'{"a": 1}', b'{"b": 2}']
    assert len(told) == 1


@pytest.mark.parametrize(
    ("data", "problem"),
    [(b"\xff\xfe", "not UTF-8"), (b"{oops", "not JSON"), (b"[1, 2]", "not a JSON object")],
)
def test_malformed_events_are_reported(data: bytes, problem: str) -> None:
    ((payload, _),) = _fed(EventFramer(), b"data: " + data + b"\n\n")
    assert isinstance(payload, bytes)
    with pytest.raises(MalformedEvent, match=problem):
        decode_event_json(payload)


_LINES = st.sampled_from(
    [
        b'data: {"c": "x"}',
        b'data:{"c":"\xe2\x80\x94"}',
        b"data: [DONE]",
        b"data:  [DONE]",
        b"data",
        b"data: ",
        b": keep-alive",
        b":",
        b"event: message",
        b"id: 12",
        b"retry: 5",
        b"",
        b"data: {",
        b"data: }",
    ]
)
_ENDINGS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_LINES, _ENDINGS), max_size=40),
    st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=10),
)
def test_any_stream_split_anywhere_frames_as_its_plainest_reading(
    lines: list[tuple[bytes, bytes]], pieces: list[int]
) -> None:
    stream = b"".join(line + ending for line, ending in lines)
    framer = EventFramer()
    seen: list[Seen] = []
    at, turn = 0, 0
    while at < len(stream):
        size = pieces[turn % len(pieces)]
        seen += _fed(framer, stream[at : at + size])
        at, turn = at + size, turn + 1
    assert seen == _reference(stream[: len(stream) - len(framer.pending)])
