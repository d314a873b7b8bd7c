"""A proxy pod's memory as it outlives the process: what it learned about each machine,
kept across a restart (a state file) and, in a fleet, shared with the other pods.

A `PodMemory` holds only the pod's own evidence, never what it heard: every pod shares
what it saw, each pod adds up its peers' shares, and nothing is ever counted twice (a pod
that heard A's evidence does not pass it on to B, who hears it from A). Ages are kept
relative to the moment the memory was written, so pods whose clocks disagree still agree
on how old a piece of evidence is, give or take the disagreement at write time.

Pure: the clock is an argument; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from rolegate_policy.status import TripReason

from .beliefs import Ledger, MachineEvidence, MachineKey
from .breaker import Breakers, FaultMarks, PeerTrip, RateCount
from .exclusions import BreakerKey
from .load import FLEET_LOAD_SECONDS, Load
from .score import Scoreboard, ScoreEvidence

# A memory older than this is not taken back at start: what it knew is stale anyway (the
# ledger forgets on a half-hour half-life; a day is 48 of them), and a file left behind by
# an old deployment must not haunt a new one.
MAX_RESTORE_AGE_SECONDS: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class PodMemory:
    """What one pod learned, as of `written_at` (seconds since the epoch)."""

    pod: str
    written_at: float
    # The speed beliefs' evidence (the ledger's), and the operational scores' records.
    machines: tuple[MachineEvidence, ...] = ()
    scores: tuple[tuple[MachineKey, ScoreEvidence], ...] = ()
    # The breakers' novelty baseline: when each fault signature was seen, per key.
    faults: tuple[FaultMarks, ...] = ()
    # The breakers this pod holds open (or half-open) now: the fleet keeps them out too.
    trips: tuple[tuple[BreakerKey, TripReason], ...] = ()
    # Its breakers' rate windows: the fleet's rate arms count them.
    rates: tuple[RateCount, ...] = ()
    # Its requests in flight per machine: the fleet's queues (SPEC B8).
    in_flight: tuple[tuple[MachineKey, int], ...] = ()


def remember(
    pod: str,
    ledger: Ledger,
    scores: Scoreboard,
    now: float,
    wall_now: float,
    *,
    breakers: Breakers | None = None,
    load: Load | None = None,
) -> PodMemory:
    """The pod's own memory now (`now` on the ledger's clock, `wall_now` the epoch's)."""
    faults = () if breakers is None else tuple(breakers.fault_marks(now))
    trips = () if breakers is None else tuple(breakers.own_trips(now))
    rates = () if breakers is None else tuple(breakers.rate_counts())
    in_flight = () if load is None else tuple(load.snapshot(now).items())
    return PodMemory(
        pod=pod,
        written_at=wall_now,
        machines=tuple(ledger.evidence(now)),
        scores=tuple(scores.records()),
        faults=faults,
        trips=trips,
        rates=rates,
        in_flight=in_flight,
    )


def restore(
    memory: PodMemory,
    ledger: Ledger,
    scores: Scoreboard,
    now: float,
    wall_now: float,
    *,
    breakers: Breakers | None = None,
) -> bool:
    """Take the pod's own memory back into a fresh ledger, scoreboard and breakers; False
    when it is too old to. (Beliefs are forgotten for the time spent on the shelf; a score
    decays per observation, not per hour, so it comes back as it was; a fault signature
    stays familiar for the rest of its novelty window.)"""
    age = max(0.0, wall_now - memory.written_at)
    if age > MAX_RESTORE_AGE_SECONDS:
        return False
    ledger.restore(memory.machines, age, now)
    scores.restore(memory.scores, now)
    if breakers is not None:
        breakers.restore_marks(memory.faults, age, now)
    return True


def hear_fleet(
    memories: Iterable[PodMemory],
    own_pod: str,
    ledger: Ledger,
    scores: Scoreboard,
    now: float,
    wall_now: float,
    *,
    breakers: Breakers | None = None,
    trip_expiry: float = 0.0,
    load: Load | None = None,
) -> None:
    """Take every peer's memory into this pod's priors, each weighted by its age (halved
    every ledger half-life: an hour-old report counts a quarter), this pod's own skipped
    (the ledger and scoreboard already have it). Replaces what was heard before.

    With `breakers`, a breaker a peer holds open keeps its key out here too, for as long
    as that peer's memory is younger than `trip_expiry` seconds (a pod that stops writing
    stops excluding); the peer's next memory without it lifts it. The fresh memories' rate
    windows count in this pod's rate arms. With `load`, the requests peers had in flight
    count in this pod's queues while their memories are younger than FLEET_LOAD_SECONDS."""
    half_life = ledger.settings.half_life_seconds
    peers = [
        (memory, 0.5 ** (max(0.0, wall_now - memory.written_at) / half_life))
        for memory in memories
        if memory.pod != own_pod
    ]
    ledger.hear(((item, weight) for memory, weight in peers for item in memory.machines), now)
    scores.hear(
        ((key, evidence, weight) for memory, weight in peers for key, evidence in memory.scores),
        now,
    )
    if breakers is not None:
        fresh = [
            (memory, age)
            for memory, _ in peers
            if (age := max(0.0, wall_now - memory.written_at)) < trip_expiry
        ]
        breakers.hear_trips(
            PeerTrip(key, reason, memory.pod, now + trip_expiry - age)
            for memory, age in fresh
            for key, reason in memory.trips
        )
        breakers.hear_rates(count for memory, _ in fresh for count in memory.rates)
    if load is not None:
        load.hear(
            (key, count, now + FLEET_LOAD_SECONDS - age)
            for memory, _ in peers
            if (age := max(0.0, wall_now - memory.written_at)) < FLEET_LOAD_SECONDS
            for key, count in memory.in_flight
        )
