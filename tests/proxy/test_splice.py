"""Where a continuation meets what the client has (`core/splice.py`, SPEC E7): an echo of
the delivered text from a machine declared to echo is dropped, wherever its events split
it; nothing is dropped from a machine that is not; a stop sequence across the seam ends
the answer."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from rolegate_proxy.core.splice import Passed, Splice

TEXT = st.text(alphabet="ab é日🎉\u0301\n", max_size=20)


def _through(splice: Splice, pieces: list[str]) -> tuple[str, bool]:
    """What passes of the pieces, the held rest at their end, and whether a stop ended it."""
    out: list[str] = []
    for piece in pieces:
        passed = splice.feed(piece)
        if passed.stopped:
            return "".join(out), True
        out.append(passed.text)
    out.append(splice.interrupt())
    return "".join(out), False


def _cuts(text: str, data: st.DataObject) -> list[str]:
    points = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6), label="cuts"))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(delivered=TEXT.filter(bool), rest=TEXT, data=st.data())
def test_an_echo_split_anywhere_is_dropped_whole(
    delivered: str, rest: str, data: st.DataObject
) -> None:
    pieces = _cuts(delivered + rest, data)
    assert _through(Splice(delivered, (), echoes=True), pieces) == (rest, False)


@given(delivered=TEXT.filter(bool), rest=TEXT, data=st.data())
def test_a_machine_not_declared_to_echo_keeps_every_byte(
    delivered: str, rest: str, data: st.DataObject
) -> None:
    """A continuation that begins like the delivered text is new text: `a a` goes on `a a`."""
    pieces = _cuts(delivered + rest, data)
    assert _through(Splice(delivered, (), echoes=False), pieces) == (delivered + rest, False)


def test_an_echoing_machine_that_does_not_echo_this_time_loses_nothing() -> None:
    splice = Splice("Hello wor", (), echoes=True)
    assert splice.feed("Hel") == Passed("")
    assert splice.feed("ping out") == Passed("Helping out")
    assert splice.settled


def test_an_echo_less_its_trailing_whitespace_is_an_echo() -> None:
    splice = Splice("Dear Sir, ", (), echoes=True)
    assert splice.feed("Dear Sir,") == Passed("")
    assert splice.feed("\nthank you") == Passed("\nthank you")


def test_an_echo_cut_short_by_the_end_of_the_continuation_passes_nothing() -> None:
    splice = Splice("Hello world", (), echoes=True)
    assert splice.feed("Hello") == Passed("")
    assert splice.interrupt() == ""


def test_a_stop_sequence_across_the_seam_ends_the_answer() -> None:
    splice = Splice("the end is ST", ("STOP",), echoes=False)
    assert splice.feed("O") == Passed("")  # `STO`: still open
    assert splice.feed("P and more") == Passed("", stopped=True)


def test_a_stop_sequence_that_does_not_complete_lets_the_held_text_through() -> None:
    splice = Splice("the end is ST", ["STOP", "\n\n"], echoes=False)
    assert splice.feed("O") == Passed("")
    assert splice.feed("MP") == Passed("OMP")
    assert splice.settled


def test_a_stop_sequence_after_an_echo_is_found_in_what_follows_it() -> None:
    splice = Splice("Item 1\n", ["\n\n"], echoes=True)
    assert splice.feed("Item 1\n") == Passed("")
    assert splice.feed("\nItem 2") == Passed("", stopped=True)


def test_text_held_at_the_seam_goes_on_when_a_tool_call_ends_the_text() -> None:
    splice = Splice("say ST", ["STOP"], echoes=False)
    assert splice.feed("O") == Passed("")
    assert splice.interrupt() == "O"


@given(delivered=TEXT, rest=TEXT, stop=st.text(alphabet="ab\n", min_size=1, max_size=4))
def test_the_seam_never_passes_a_stop_sequence_that_straddles_it(
    delivered: str, rest: str, stop: str
) -> None:
    passed, stopped = _through(Splice(delivered, [stop], echoes=False), [rest])
    straddles = any(
        (delivered + rest)[start:].startswith(stop)
        for start in range(max(0, len(delivered) - len(stop) + 1), len(delivered))
    )
    if straddles:
        assert stopped
    else:
        assert (passed, stopped) == (rest, False)
