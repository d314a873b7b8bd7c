"""Reading a stream's events without parsing each whole: `ChunkReader` says of every event
exactly what parsing it whole (`read_chunk`) says, or it is wrong. A content delta like the
one learned from comes back as its text alone, and that text must be what the parse reads,
the chunk otherwise the same (no finish, no usage, no tool call, no error)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolegate_proxy.wire import openai
from rolegate_proxy.wire.answers import NO_PIECES, Chunk
from rolegate_proxy.wire.sse import MalformedEvent, decode_event_json

HEAD = (
    b'{"id":"gen-1","object":"chat.completion.chunk","created":1,"model":"m/a",'
    b'"provider":"p1","choices":[{"index":0,"delta":{"content":'
)
TAIL = b'},"finish_reason":null}]}'


def _event(text: str, head: bytes = HEAD, tail: bytes = TAIL) -> bytes:
    return head + json.dumps(text, ensure_ascii=False).encode() + tail


def _whole(data: bytes, *, named: bool = True) -> Chunk | None:
    """What parsing the event whole says (None: it is malformed)."""
    try:
        return openai.read_chunk(decode_event_json(data), named=named)
    except MalformedEvent:
        return None


def _read(reader: openai.ChunkReader, data: bytes) -> Chunk | str | None:
    try:
        return reader.read(data)
    except MalformedEvent:
        return None


def _agrees(got: Chunk | str | None, whole: Chunk | None) -> bool:
    if not isinstance(got, str):
        return got == whole
    # Text alone stands for a plain content delta with that text (its names aside: the
    # chunk learned from, read whole before it, named them).
    return whole is not None and whole == Chunk(
        got, True, True, NO_PIECES, "", "", 1, None, None, None, False, whole.model,
        whole.machine, None,
    )  # fmt: skip


def test_the_content_deltas_after_the_first_come_back_as_their_text() -> None:
    reader = openai.ChunkReader(named=True)
    role = HEAD.replace(b'"content":', b'"role":"assistant","content":') + b'""' + TAIL
    first = reader.read(role)
    assert isinstance(first, Chunk)
    assert not first.has_content  # the role delta: nothing to learn from
    learned = reader.read(_event("Hello"))
    assert learned == _whole(_event("Hello"))  # read whole: its names go out first
    assert isinstance(learned, Chunk)
    assert (learned.model, learned.machine) == ("m/a", "p1")
    texts = ["", ' "quoted" ', "back\\slash", "é — 日本語 🚀", "\n", '","x":"']
    assert [reader.read(_event(text)) for text in texts[1:]] == texts[1:]
    # An empty text is no content: the event is read whole.
    assert reader.read(_event("")) == _whole(_event(""))


@pytest.mark.parametrize(
    "data",
    [
        # The finish, usage, a tool call, an error: read whole, whatever bytes surround them.
        HEAD + b'"a"}, "finish_reason":"stop"}]}',
        HEAD + b'"a"' + TAIL[:-1] + b',"usage":{"prompt_tokens":3,"completion_tokens":4}}',
        HEAD + b'"a","tool_calls":[{"id":"t"}]' + TAIL,
        HEAD + b'"a","reasoning_content":"thinking"' + TAIL,
        HEAD + b'"a","reasoning":"thinking"' + TAIL,
        HEAD + b'"a","refusal":"no"' + TAIL,
        HEAD + b'"a"' + TAIL[:-1] + b',"error":{"code":"server_error"}}',
        # Not one JSON string where the text was.
        HEAD + b"1" + TAIL,
        HEAD + b'"a","content":"b"' + TAIL,
        HEAD + b'"\xff"' + TAIL,
        HEAD + b'"a' + TAIL,
        # Whitespace around it is JSON too.
        HEAD + b' "spaced" ' + TAIL,
        HEAD + b'"\\u0041\\n"' + TAIL,
    ],
)
def test_an_event_that_is_more_than_text_is_read_as_parsing_it_whole_reads_it(
    data: bytes,
) -> None:
    reader = openai.ChunkReader(named=True)
    reader.read(_event("learned"))
    assert _agrees(_read(reader, data), _whole(data))


@pytest.mark.parametrize(
    ("head", "tail"),
    [
        # The text's place is in doubt: nothing is learned, every event is read whole.
        (b'{"x":{"content":', b'},"choices":[{"delta":{"content":"a"}}]}'),  # another object
        (b'{"choices":[{"delta":{"content":', b',"content":"z"}}]}'),  # a later duplicate
        (b'{"id":"a\\"","choices":[{"delta":{"content":', b"}}]}"),  # an escape before it
        (b'{"choices":[{"delta":{"content":', b'},"x":"\\u0041"}]}'),  # an escape after it
        (b'{"id":"content","choices":[{"delta":{"content":', b"}}]}"),  # the key spelled twice
        (b'{"choices":[{"delta":{"content": ', b"}}]}"),  # not right after its key
    ],
)
def test_a_text_whose_place_is_in_doubt_is_never_read_alone(head: bytes, tail: bytes) -> None:
    reader = openai.ChunkReader(named=False)
    for text in ["a", "b", "c"]:
        data = _event(text, head, tail)
        got = reader.read(data)
        assert not isinstance(got, str)
        assert got == _whole(data, named=False)


@pytest.mark.parametrize(
    "beside",
    [b'"reasoning_content":"why"', b'"reasoning":"why"', b'"refusal":"no"',
     b'"tool_calls":[{"index":0,"function":{"arguments":"{"}}]'],
)  # fmt: skip
def test_a_delta_with_more_than_its_text_is_never_learned_from(beside: bytes) -> None:
    """Learned from, its shape would read the same reasoning (or refusal, or tool call)
    again in every later event as text alone: that output would be lost."""
    head = HEAD.replace(b'"delta":{', b'"delta":{' + beside + b",")
    reader = openai.ChunkReader(named=True)
    for text in ["a", "b", "c"]:
        data = _event(text, head)
        got = reader.read(data)
        assert isinstance(got, Chunk)
        assert got == _whole(data)
        assert got.outputs == 2


def test_a_delta_with_empty_fields_beside_its_text_is_learned_from() -> None:
    head = HEAD.replace(b'"delta":{', b'"delta":{"role":"assistant","reasoning_content":null,')
    reader = openai.ChunkReader(named=True)
    reader.read(_event("a", head))
    assert reader.read(_event("b", head)) == "b"


def test_a_stream_whose_bytes_change_around_the_text_is_read_whole() -> None:
    reader = openai.ChunkReader(named=True)
    reader.read(_event("a"))
    other = HEAD.replace(b"gen-1", b"gen-2")
    assert reader.read(_event("b", other)) == _whole(_event("b", other))
    assert reader.read(_event("c")) == "c"


_HEADS = st.sampled_from(
    [
        HEAD,
        b'{"id":"g","model":"m","choices":[{"delta":{"role":"assistant","content":',
        b'{"id":"c\\"x","choices":[{"delta":{"content":',
        b'{"x":{"content":',
        b'{"choices":[{"delta":{"content":"a","content":',
        b'{"id":"content","choices":[{"delta":{"content":',
        b'{"usage":null,"choices":[{"delta":{"content":',
        b'{"choices":[{"delta":{"content": ',
        b'{"choices":[{"delta":{"cont\\u0065nt":"a","content":',
        b'{"choices":[{"delta":{"reasoning":"r","content":',
        b'{"choices":[{"finish_reason":"stop","delta":{"content":',
    ]
)
_TAILS = st.sampled_from(
    [
        TAIL,
        b"}}]}",
        b'},"finish_reason":"stop"}]}',
        b'}}],"usage":{"prompt_tokens":1}}',
        b'},"content":"z"}]}',
        b'}}],"x":"\\u0041"}',
        b"}}]",
        b'},"logprobs":null,"finish_reason":null}],"obfuscation":"ab"}',
        b'}},{"delta":{"content":"second"}}]}',
        b',"cont\\u0065nt":"z"}}]}',
    ]
)
_TOKENS = st.one_of(
    st.text(max_size=6).map(lambda text: json.dumps(text, ensure_ascii=False).encode()),
    st.text(max_size=6).map(lambda text: json.dumps(text).encode()),
    st.sampled_from([b'"a","tool_calls":[1]', b' "a" ', b"1", b"null", b'"\xff"', b'"', b""]),
)


@settings(max_examples=500, deadline=None)
@given(st.booleans(), st.lists(st.tuples(_HEADS, _TOKENS, _TAILS), min_size=1, max_size=12))
def test_any_stream_reads_as_parsing_each_event_whole_reads_it(
    named: bool, events: list[tuple[bytes, bytes, bytes]]
) -> None:
    reader = openai.ChunkReader(named=named)
    for head, token, tail in events:
        data = head + token + tail
        assert _agrees(_read(reader, data), _whole(data, named=named))
