"""Requests in flight and each machine's concurrency (SPEC B8; core/load.py). Pure."""

from __future__ import annotations

import pytest

from rolegate_proxy.core.beliefs import Ledger, MachineKey
from rolegate_proxy.core.fleet import PodMemory, hear_fleet, remember
from rolegate_proxy.core.load import MAX_TICKET_SECONDS, Load
from rolegate_proxy.core.score import Scoreboard

A = MachineKey("agg", "model", "a")
B = MachineKey("agg", "model", "b")


def test_a_busy_machine_waits_a_share_of_an_answer_per_request_ahead() -> None:
    load = Load()
    assert load.wait_seconds(A, 10.0, None, 0.0) == 0.0
    first = load.take(A, 0.0)
    # Unpublished and untaught: one at a time, so the next waits a whole answer.
    assert load.wait_seconds(A, 10.0, None, 0.0) == pytest.approx(10.0)
    # Published to serve four at once: no wait until four are in flight.
    assert load.wait_seconds(A, 10.0, 4, 0.0) == 0.0
    for _ in range(3):
        load.take(A, 0.0)
    assert load.wait_seconds(A, 10.0, 4, 0.0) == pytest.approx(2.5)
    assert load.busy("agg", "model", 0.0)
    assert not load.busy("agg", "other", 0.0)
    load.give_back(first, None)
    load.give_back(first, None)  # once only
    assert load.in_flight(A, 0.0) == 3


def test_a_ticket_moves_with_the_machine_the_aggregator_named() -> None:
    load = Load()
    ticket = load.take(A, 0.0)
    load.move(ticket, B)
    assert (load.in_flight(A, 0.0), load.in_flight(B, 0.0)) == (0, 1)
    load.give_back(ticket, None)
    assert not load.busy("agg", "model", 0.0)


def test_concurrency_is_learned_from_first_tokens_under_load() -> None:
    load = Load()
    # Unloaded first tokens at 0.2 s teach the baseline.
    for _ in range(3):
        load.give_back(load.take(A, 0.0), 0.2)
    # Three at once, each first token on time: it serves at least three.
    tickets = [load.take(A, 1.0) for _ in range(3)]
    for ticket in tickets:
        load.give_back(ticket, 0.25)
    assert load.concurrency(A, None) == 3
    # Four at once, the fourth's first token waited a whole answer: it serves three.
    tickets = [load.take(A, 2.0) for _ in range(4)]
    for ticket in tickets[:3]:
        load.give_back(ticket, 0.2)
    load.give_back(tickets[3], 5.0)
    assert load.concurrency(A, None) == 3
    # A published figure is the truth.
    assert load.concurrency(A, 8) == 8


def test_a_lost_ticket_stops_counting_and_peers_count_while_fresh() -> None:
    load = Load()
    load.take(A, 0.0)
    assert load.in_flight(A, MAX_TICKET_SECONDS - 1) == 1
    assert load.in_flight(A, MAX_TICKET_SECONDS + 1) == 0
    assert not load.busy("agg", "model", MAX_TICKET_SECONDS + 1)
    load.hear([(B, 1, 100.0), (B, 1, 70.0)])
    assert load.in_flight(B, 11.0) == 2
    assert load.busy("agg", "model", 11.0)
    assert load.in_flight(B, 1000.0) == 0


def test_the_fleet_s_requests_in_flight_count_while_its_memories_are_fresh() -> None:
    peer_load = Load()
    peer_load.take(A, 0.0)
    peer_load.take(A, 0.0)
    published = remember("peer", Ledger(), Scoreboard(), 0.0, 1000.0, load=peer_load)
    assert published.in_flight == ((A, 2),)
    load = Load()
    own = PodMemory("me", 1000.0, in_flight=((A, 5),))  # this pod's own: never heard
    hear_fleet([published, own], "me", Ledger(), Scoreboard(), 0.0, 1010.0, load=load)
    assert load.in_flight(A, 0.0) == 2
    assert load.in_flight(A, 60.0) == 0  # written 10 s before it was heard: 50 s to stand
    stale = Load()
    hear_fleet([published], "me", Ledger(), Scoreboard(), 0.0, 1100.0, load=stale)
    assert stale.in_flight(A, 0.0) == 0
