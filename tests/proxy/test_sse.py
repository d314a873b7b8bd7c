"""The byte-level event framer: a character split across reads must survive (SPEC A1)."""

from __future__ import annotations

import json

import pytest

from rolegate_proxy.wire.sse import EventFramer, MalformedEvent, decode_event_json

TEXT = "em dash — café naïve 日本語のテキスト 🚀 done"


def _stream(*payloads: dict[str, object]) -> bytes:
    out = b""
    for payload in payloads:
        out += b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _contents(framer_output: list[bytes]) -> str:
    return "".join(json.loads(data)["c"] for data in framer_output)


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64])
def test_every_split_position_reassembles_exactly(piece: int) -> None:
    events: list[dict[str, object]] = [{"c": word} for word in TEXT.split(" ")]
    raw = _stream(*events)
    framer = EventFramer()
    datas: list[bytes] = []
    done = False
    for start in range(0, len(raw), piece):
        for event in framer.feed(raw[start : start + piece]):
            if event.is_done:
                done = True
            else:
                datas.append(event.data)
    assert done
    assert framer.pending == b""
    assert _contents(datas) == "".join(TEXT.split(" "))


def test_a_split_multibyte_character_waits_for_its_second_half() -> None:
    event = 'data: {"c": "—"}\n\n'.encode()
    cut = event.index("—".encode()) + 1  # inside the three bytes of the em dash
    framer = EventFramer()
    assert framer.feed(event[:cut]) == []
    (whole,) = framer.feed(event[cut:])
    assert decode_event_json(whole) == {"c": "—"}
    assert whole.raw == event


def test_crlf_line_endings_and_a_cr_split_from_its_lf() -> None:
    raw = b'data: {"c": "a"}\r\n\r\ndata: {"c": "b"}\r\n\r\n'
    framer = EventFramer()
    split = raw.index(b"\r\n\r\n") + 1
    first = framer.feed(raw[:split])
    rest = framer.feed(raw[split:])
    assert [decode_event_json(e)["c"] for e in first + rest] == ["a", "b"]


def test_comments_are_events_of_their_own_and_fields_other_than_data_are_ignored() -> None:
    framer = EventFramer()
    events = framer.feed(b': OPENROUTER PROCESSING\n\nevent: x\nid: 1\ndata: {"c": 1}\n\n')
    assert events[0].is_comment
    assert events[1].data == b'{"c": 1}'


def test_multi_line_data_is_joined_with_newlines() -> None:
    (event,) = EventFramer().feed(b'data: {"c":\ndata: 2}\n\n')
    assert decode_event_json(event) == {"c": 2}


@pytest.mark.parametrize(
    ("data", "problem"),
    [(b"\xff\xfe", "not UTF-8"), (b"{oops", "not JSON"), (b"[1, 2]", "not a JSON object")],
)
def test_malformed_events_are_reported(data: bytes, problem: str) -> None:
    (event,) = EventFramer().feed(b"data: " + data + b"\n\n")
    with pytest.raises(MalformedEvent, match=problem):
        decode_event_json(event)
