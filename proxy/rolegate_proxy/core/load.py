"""How busy each machine is: requests in flight on it, and how many it serves at once
(SPEC B8).

A request sent to a machine that is already serving as many as it can waits in its queue
before its first token: a single-slot llama.cpp server answering one stream makes the
next wait for the whole of it. So routing counts the wait in a machine's expected time:

    wait = max(0, in_flight + 1 - concurrency) / concurrency x service

where `in_flight` is the requests on the machine now (this pod's arms, plus what peers
published: `hear`), `concurrency` the machine's published `maxConcurrency`, else the
learned one, and `service` its expected time for one answer (TTFT plus the role's tokens
at its rate). Two equal machines, one busy: the idle one is faster by a whole answer, so
concurrent requests spread instead of queueing on one while the other idles.

**Learned concurrency.** Unpublished, a machine is first taken to serve one request at a
time (the assumption that costs least when wrong: it only spreads requests over machines
of equal quality that could have shared them). Each streamed answer then says how many it
shared the machine with: one sent with `load` requests on it (itself included) whose first
token came no later than QUEUED_FACTOR times the machine's unloaded first token (a running
mean over answers sent to it idle) was served without waiting, so the machine serves at
least `load` at once; one that waited longer says it serves fewer. So a big aggregator
sub-provider is soon known to take many, and a single-slot server stays at one.

A `Ticket` is one arm in flight on one machine: taken when the arm is sent, moved when an
aggregator names another machine, returned once when the arm ends (idempotent). A ticket
never returned (an arm lost to a bug) stops counting after MAX_TICKET_SECONDS, so a leak
cannot make a machine look busy for ever.

Pure: the clock is an argument; nothing here waits or sends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from .beliefs import MachineKey

# A first token this many times later than the machine's unloaded mean waited in a queue.
QUEUED_FACTOR: Final = 2.0
# ... and at least this much later, in seconds (a 10 ms first token at 25 ms did not queue).
QUEUED_MARGIN_SECONDS: Final = 0.1
# Weight of a new unloaded first token in the running mean.
UNLOADED_ALPHA: Final = 0.2
# An arm in flight longer than this is not counted (its end was lost).
MAX_TICKET_SECONDS: Final = 1800.0
# A peer's published in-flight counts stand this long after it wrote them (its memory's
# age counts: a pod writes every 30 s by default, so its counts are that stale at worst).
FLEET_LOAD_SECONDS: Final = 60.0
# Machines whose learned concurrency is kept at most (least recently taught forgotten).
MAX_LEARNED: Final = 4096


@dataclass(slots=True, eq=False)
class Ticket:
    """One arm in flight on one machine, in the `owner`'s count."""

    owner: Load
    key: MachineKey
    started: float
    # Requests on the machine when the arm was sent (the fleet's as heard), itself
    # included.
    load: int
    returned: bool = False


@dataclass(frozen=True, slots=True)
class LoadRow:
    """One machine's load as the state endpoint shows it."""

    key: MachineKey
    in_flight: int
    fleet_in_flight: int
    # Learned from its first tokens under load (None: nothing learned yet, taken as 1).
    learned_concurrency: int | None


@dataclass(slots=True)
class _Learned:
    concurrency: int = 1
    unloaded_ttft: float | None = None


@dataclass(slots=True)
class _FleetLoad:
    in_flight: int
    until: float


@dataclass(slots=True)
class Load:
    """Requests in flight per machine, this pod's and the fleet's, and each machine's
    concurrency. Not thread-safe (the event loop's)."""

    # Each machine's tickets out, by identity, oldest first (removed in O(1) when returned).
    _tickets: dict[MachineKey, dict[int, Ticket]] = field(default_factory=dict)
    # Tickets out per (provider, model): whether a ranking needs load applied at all.
    _per_model: dict[tuple[str, str], int] = field(default_factory=dict)
    _learned: dict[MachineKey, _Learned] = field(default_factory=dict)
    _fleet: dict[MachineKey, _FleetLoad] = field(default_factory=dict)
    _fleet_models: dict[tuple[str, str], float] = field(default_factory=dict)

    # -- arms -----------------------------------------------------------------------------

    def take(self, key: MachineKey, now: float) -> Ticket:
        """An arm sent to `key`: it counts from now until its ticket is returned."""
        ticket = Ticket(self, key, now, self.in_flight(key, now) + 1)
        self._add(ticket)
        return ticket

    def move(self, ticket: Ticket, key: MachineKey) -> None:
        """The arm turned out to be on `key` (an aggregator named the machine it chose)."""
        if ticket.returned or ticket.key == key:
            return
        self._remove(ticket)
        ticket.key = key
        self._add(ticket)

    def give_back(self, ticket: Ticket, ttft: float | None) -> None:
        """The arm ended; `ttft` is its first token's time after sending when it streamed
        one (what teaches the machine's concurrency). Only the first call counts."""
        if ticket.returned:
            return
        self._remove(ticket)
        ticket.returned = True
        if ttft is not None:
            self._teach(ticket.key, ticket.load, ttft)

    # -- reading --------------------------------------------------------------------------

    def own(self, key: MachineKey, now: float) -> int:
        """This pod's arms in flight on `key`."""
        tickets = self._tickets.get(key)
        if not tickets:
            return 0
        oldest = now - MAX_TICKET_SECONDS
        if next(iter(tickets.values())).started < oldest:
            for stale in [t for t in tickets.values() if t.started < oldest]:
                self._remove(stale)
                stale.returned = True
            return len(self._tickets.get(key, ()))
        return len(tickets)

    def in_flight(self, key: MachineKey, now: float) -> int:
        """Requests on `key`: this pod's, and its peers' as they last published them."""
        fleet = self._fleet.get(key)
        heard = fleet.in_flight if fleet is not None and now < fleet.until else 0
        return self.own(key, now) + heard

    def out(self) -> int:
        """This pod's arms in flight, on every machine."""
        return sum(self._per_model.values())

    def busy(self, provider: str, model: str, now: float) -> bool:
        """Whether any machine of the model may have requests in flight (cheap: routing
        asks on every decision, and applies load only when so)."""
        if self._per_model.get((provider, model), 0) > 0:
            return True
        heard = self._fleet_models.get((provider, model))
        return heard is not None and now < heard

    def concurrency(self, key: MachineKey, published: int | None) -> int:
        if published is not None:
            return published
        learned = self._learned.get(key)
        return 1 if learned is None else learned.concurrency

    def wait_seconds(
        self, key: MachineKey, service_seconds: float, published: int | None, now: float
    ) -> float:
        """The expected wait in `key`'s queue of a request sent now (module docstring)."""
        in_flight = self.in_flight(key, now)
        if in_flight == 0:
            return 0.0
        concurrency = self.concurrency(key, published)
        ahead = in_flight + 1 - concurrency
        return 0.0 if ahead <= 0 else ahead / concurrency * service_seconds

    def rows(self, now: float) -> list[LoadRow]:
        """Every machine with requests in flight here or in the fleet, or a learned
        concurrency, in key order (for the state endpoint)."""
        keys = set(self._tickets) | set(self._learned)
        keys.update(key for key, heard in self._fleet.items() if now < heard.until)
        rows = []
        for key in sorted(keys):
            learned = self._learned.get(key)
            fleet = self._fleet.get(key)
            rows.append(
                LoadRow(
                    key=key,
                    in_flight=self.own(key, now),
                    fleet_in_flight=fleet.in_flight if fleet and now < fleet.until else 0,
                    learned_concurrency=None if learned is None else learned.concurrency,
                )
            )
        return rows

    def snapshot(self, now: float) -> dict[MachineKey, int]:
        """This pod's in-flight counts, to publish to the fleet."""
        return {key: count for key in list(self._tickets) if (count := self.own(key, now))}

    def hear(self, published: Iterable[tuple[MachineKey, int, float]]) -> None:
        """Peers' in-flight counts, each `(key, count, until)`: summed per machine over the
        peers, standing until the earliest of theirs; replaces what was heard before."""
        fleet: dict[MachineKey, _FleetLoad] = {}
        for key, count, until in published:
            if count <= 0:
                continue
            held = fleet.get(key)
            if held is None:
                fleet[key] = _FleetLoad(count, until)
            else:
                held.in_flight += count
                held.until = min(held.until, until)
        self._fleet = fleet
        models: dict[tuple[str, str], float] = {}
        for key, heard in fleet.items():
            model = (key.provider, key.model)
            models[model] = max(models.get(model, heard.until), heard.until)
        self._fleet_models = models

    # -- internals ------------------------------------------------------------------------

    def _add(self, ticket: Ticket) -> None:
        self._tickets.setdefault(ticket.key, {})[id(ticket)] = ticket
        model = (ticket.key.provider, ticket.key.model)
        self._per_model[model] = self._per_model.get(model, 0) + 1

    def _remove(self, ticket: Ticket) -> None:
        tickets = self._tickets.get(ticket.key)
        if tickets is None or tickets.pop(id(ticket), None) is None:
            return
        if not tickets:
            del self._tickets[ticket.key]
        model = (ticket.key.provider, ticket.key.model)
        left = self._per_model.get(model, 1) - 1
        if left > 0:
            self._per_model[model] = left
        else:
            self._per_model.pop(model, None)

    def _teach(self, key: MachineKey, load: int, ttft: float) -> None:
        if not (ttft >= 0 and math.isfinite(ttft)):
            return
        learned = self._learned.pop(key, None) or _Learned()
        self._learned[key] = learned  # most recently taught last
        while len(self._learned) > MAX_LEARNED:
            del self._learned[next(iter(self._learned))]
        base = learned.unloaded_ttft
        if load <= 1:
            learned.unloaded_ttft = ttft if base is None else base + UNLOADED_ALPHA * (ttft - base)
            return
        if base is None:
            return
        if ttft <= QUEUED_FACTOR * base + QUEUED_MARGIN_SECONDS:
            learned.concurrency = max(learned.concurrency, load)
        else:
            learned.concurrency = max(1, min(learned.concurrency, load - 1))
