"""The wire format of a pod's memory (core/fleet.PodMemory): compact JSON, versioned,
bounded, and read as untrusted input.

    {"format": 1, "pod": "rolegate-proxy-7d9f-abcde", "writtenAt": 1764763200.0,
     "machines": [["openrouter", "qwen/qwen3-coder", "deepinfra", 42,
                   [8.1, -3.2, 1.9], [8.0, -24.6, 76.1], [42, 0.97619, 25.3]], ...],
     "faults": [["openrouter", "qwen/qwen3-coder", null, "empty_response",
                 [80412.5, 3601.2, 12.0]], ...],
     "trips": [["openrouter", "qwen/qwen3-coder", "deepinfra", "EmptyResponses"], ...],
     "rates": [["openrouter", "qwen/qwen3-coder", null, "content", 40, 14], ...],
     "completions": [["openrouter", "qwen/qwen3-coder", "deepinfra", [16, 3.1, 4.2]], ...]}

Each machine is `[provider, model, machine, sightings, ttft, gap, score]`: `ttft` and
`gap` are `[n, sum of logs, sum of squared logs]` (the ledger's evidence), `score` is
`[observations, smoothed mean, weight]` (the operational score's record); each null when
there is none. Numbers are kept to six significant digits. About 130 bytes a machine with
typical names: 1,000 machines are ~130 KB, well inside etcd's 1.5 MiB object limit and a
file written in a millisecond. Each fault row is `[provider, model, machine, signature,
ages]`: a breaker key (model and machine null for a wider key), a fault signature, and
when it was seen, in seconds before `writtenAt` (the novelty baseline). Each trip row is
`[provider, model, machine, reason]`: a breaker the pod holds open now. Each rate row is
`[provider, model, machine, family, outcomes, faults]`: a breaker key's rate window. Each
in-flight row is `[provider, model, machine, count]`: the pod's requests on that machine
as it wrote (what the fleet's routing counts in its queues; absent in older memories).
Each completion row is `[provider, model, machine, pace]`: the evidence of the pace of that
machine's whole non-streamed answers (core/beliefs.py), kept apart from its gaps (SPEC B7).
It is a key of its own, not an eighth column of a machine row, so that a pod of an earlier
version, which refuses a machine row of any other length, still reads the memory (it
ignores keys it does not know); a memory without it (an earlier pod's) reads as no paces.

A memory that does not parse, names a newer format, or breaks a bound is refused whole
(`MemoryFormatError`): a pod starts cold rather than from a half-read memory. The bounds
are on values as well as shape (core/plausible.py, SPEC E8): each evidence's mean log
must be a plausible TTFT or gap, its sum of squares consistent with its sum, its count no
more than a ledger keeps; scores, sightings, windows and ages within what a pod counts;
`writtenAt` not in the future. The error names the field (`machines[3]: ttft`), never a
value. `encode` writes nothing `decode` would refuse.
"""

from __future__ import annotations

import math
import time
from typing import Any, Final, TypeGuard

import orjson

from rolegate_policy.model import MAX_MEMORY_MACHINES
from rolegate_policy.signatures import Family
from rolegate_policy.status import TripReason

from ..core.beliefs import Evidence, MachineEvidence, MachineKey
from ..core.breaker import FaultMarks, RateCount
from ..core.exclusions import BreakerKey
from ..core.fleet import PodMemory
from ..core.plausible import (
    GAP_LOG,
    MAX_CLOCK_SKEW_SECONDS,
    MAX_COUNT,
    MAX_FAULT_AGE_SECONDS,
    MAX_RATE_WINDOW,
    PACE_LOG,
    TTFT_LOG,
    LogRange,
    evidence_fault,
    within,
)
from ..core.score import ScoreEvidence

FORMAT: Final = 1
# Machines a memory may hold: the ledger's own bound, and the ProxyMemory kind's.
MAX_MACHINES: Final = MAX_MEMORY_MACHINES
MAX_NAME_CHARS: Final = 253
# Fault rows a memory may hold, and marks a row may hold.
MAX_FAULTS: Final = 4096
MAX_MARKS: Final = 64
# No pod has more requests in flight on one machine (a bound on what a peer may claim).
MAX_IN_FLIGHT: Final = 100_000
# No rate window is longer (BreakerSpec.rate_window's bound).
MAX_WINDOW: Final = MAX_RATE_WINDOW


class MemoryFormatError(ValueError):
    """A memory that cannot be taken in. The message names what is wrong, never quotes
    the memory (it came from outside the process)."""


def encode(memory: PodMemory) -> bytes:
    rows: dict[MachineKey, list[Any]] = {}
    for item in memory.machines:
        row = rows.setdefault(item.key, [*item.key, 0, None, None, None])
        row[3:6] = [min(item.sightings, MAX_COUNT), _evidence(item.ttft), _evidence(item.gap)]
    for key, score in memory.scores:
        row = rows.setdefault(key, [*key, 0, None, None, None])
        row[6] = [min(score.n, MAX_COUNT), _short(score.mean), _short(score.weight)]
    in_flight = [
        [*key, min(count, MAX_IN_FLIGHT)] for key, count in memory.in_flight[:MAX_MACHINES]
    ]
    completions = [
        [*item.key, _evidence(item.completion)]
        for item in memory.machines[:MAX_MACHINES]
        if item.completion is not None
    ]
    return orjson.dumps(
        {
            "format": FORMAT,
            "pod": memory.pod,
            "writtenAt": round(memory.written_at, 3),
            "machines": list(rows.values())[:MAX_MACHINES],
            "faults": [
                [*fault.key, fault.signature, ages]
                for fault in memory.faults[:MAX_FAULTS]
                if (ages := _ages(fault.ages))
            ],
            "trips": [[*key, reason.value] for key, reason in memory.trips[:MAX_FAULTS]],
            "rates": [
                [*rate.key, rate.family.value, rate.count, rate.faults]
                for rate in memory.rates[:MAX_FAULTS]
            ],
            **({"completions": completions} if completions else {}),
            **({"inFlight": in_flight} if in_flight else {}),
        }
    )


def machine_count(memory: PodMemory) -> int:
    """The machines `encode` writes a row for (those with evidence, a score or both)."""
    keys = {item.key for item in memory.machines} | {key for key, _ in memory.scores}
    return min(len(keys), MAX_MACHINES)


def _ages(ages: tuple[float, ...]) -> list[float]:
    """The marks a reader takes back: none older than any novelty window."""
    return [round(age, 1) for age in ages[-MAX_MARKS:] if 0 <= age <= MAX_FAULT_AGE_SECONDS]


def _evidence(evidence: Evidence | None) -> list[float] | None:
    if evidence is None:
        return None
    return [_short(evidence.n), _short(evidence.s1), _short(evidence.s2)]


def _short(x: float) -> float:
    return float(f"{x:.6g}")


def decode(data: bytes, now: float | None = None) -> PodMemory:
    """The memory `data` holds, read at `now` (seconds since the epoch; the wall clock when
    None), or `MemoryFormatError` naming the first field that is wrong."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise MemoryFormatError("not JSON") from None
    if not isinstance(document, dict):
        raise MemoryFormatError("not a JSON object")
    if document.get("format") != FORMAT:
        raise MemoryFormatError(f"format is not {FORMAT}")
    machines = document.get("machines")
    if not isinstance(machines, list) or len(machines) > MAX_MACHINES:
        raise MemoryFormatError(f"machines is not a list of at most {MAX_MACHINES}")
    written_at = document.get("writtenAt")
    if not _number(written_at) or written_at < 0:
        raise MemoryFormatError("writtenAt is not a time")
    if written_at > (time.time() if now is None else now) + MAX_CLOCK_SKEW_SECONDS:
        raise MemoryFormatError(
            f"writtenAt is in the future (more than {MAX_CLOCK_SKEW_SECONDS:g} s ahead)"
        )
    paces = _read_completions(document.get("completions", []))
    evidence: list[MachineEvidence] = []
    scores: list[tuple[MachineKey, ScoreEvidence]] = []
    for index, item in enumerate(machines):
        where = f"machines[{index}]"
        if not isinstance(item, list) or len(item) != 7:
            raise MemoryFormatError(f"{where} is not a list of 7")
        provider, model, machine, sightings, ttft, gap, score = item
        key = MachineKey(_name(provider, where), _name(model, where), _name(machine, where))
        if not _count(sightings):
            raise MemoryFormatError(f"{where}: sightings is not a count of 0 to {MAX_COUNT:.0e}")
        beliefs = (
            _read_evidence(ttft, f"{where}: ttft", TTFT_LOG),
            _read_evidence(gap, f"{where}: gap", GAP_LOG),
        )
        if beliefs != (None, None) or key in paces:
            evidence.append(MachineEvidence(key, *beliefs, sightings, paces.pop(key, None)))
        if score is not None:
            scores.append((key, _read_score(score, f"{where}: score")))
    faults = document.get("faults", [])
    if not isinstance(faults, list) or len(faults) > MAX_FAULTS:
        raise MemoryFormatError(f"faults is not a list of at most {MAX_FAULTS}")
    trips = document.get("trips", [])
    if not isinstance(trips, list) or len(trips) > MAX_FAULTS:
        raise MemoryFormatError(f"trips is not a list of at most {MAX_FAULTS}")
    rates = document.get("rates", [])
    if not isinstance(rates, list) or len(rates) > MAX_FAULTS:
        raise MemoryFormatError(f"rates is not a list of at most {MAX_FAULTS}")
    # A pace for a machine with no row: its machine row's sightings are unknown (0).
    evidence.extend(MachineEvidence(key, None, None, 0, pace) for key, pace in paces.items())
    in_flight = document.get("inFlight", [])
    if not isinstance(in_flight, list) or len(in_flight) > MAX_MACHINES:
        raise MemoryFormatError(f"inFlight is not a list of at most {MAX_MACHINES}")
    return PodMemory(
        pod=_name(document.get("pod"), "pod"),
        written_at=float(written_at),
        machines=tuple(evidence),
        scores=tuple(scores),
        faults=tuple(_fault(item, f"faults[{index}]") for index, item in enumerate(faults)),
        trips=tuple(_trip(item, f"trips[{index}]") for index, item in enumerate(trips)),
        rates=tuple(_rate(item, f"rates[{index}]") for index, item in enumerate(rates)),
        in_flight=tuple(
            _in_flight(item, f"inFlight[{index}]") for index, item in enumerate(in_flight)
        ),
    )


def _in_flight(item: Any, where: str) -> tuple[MachineKey, int]:
    if not isinstance(item, list) or len(item) != 4:
        raise MemoryFormatError(f"{where} is not a list of 4")
    provider, model, machine, count = item
    key = MachineKey(_name(provider, where), _name(model, where), _name(machine, where))
    if not (isinstance(count, int) and not isinstance(count, bool) and 0 < count <= MAX_IN_FLIGHT):
        raise MemoryFormatError(f"{where}: count is not a count of 1 to {MAX_IN_FLIGHT}")
    return key, count


def _read_completions(rows: Any) -> dict[MachineKey, Evidence]:
    """The completion rows, by machine (a machine named twice: the first row counts)."""
    if not isinstance(rows, list) or len(rows) > MAX_MACHINES:
        raise MemoryFormatError(f"completions is not a list of at most {MAX_MACHINES}")
    paces: dict[MachineKey, Evidence] = {}
    for index, item in enumerate(rows):
        where = f"completions[{index}]"
        if not isinstance(item, list) or len(item) != 4:
            raise MemoryFormatError(f"{where} is not a list of 4")
        provider, model, machine, pace = item
        key = MachineKey(_name(provider, where), _name(model, where), _name(machine, where))
        found = _read_evidence(pace, f"{where}: pace", PACE_LOG)
        if found is None:
            raise MemoryFormatError(f"{where}: pace is not [n, sum, sum of squares]")
        paces.setdefault(key, found)
    return paces


def _rate(item: Any, where: str) -> RateCount:
    if not isinstance(item, list) or len(item) != 6:
        raise MemoryFormatError(f"{where} is not a list of 6")
    provider, model, machine, family, count, faults = item
    key = _breaker_key(provider, model, machine, where)
    try:
        known = Family(family)
    except ValueError:
        raise MemoryFormatError(f"{where}: the family is not one rolegate knows") from None
    if not (_count(count) and _count(faults) and faults <= count <= MAX_WINDOW):
        raise MemoryFormatError(f"{where}: the counts are not a window's")
    return RateCount(key, known, count, faults)


def _trip(item: Any, where: str) -> tuple[BreakerKey, TripReason]:
    if not isinstance(item, list) or len(item) != 4:
        raise MemoryFormatError(f"{where} is not a list of 4")
    provider, model, machine, reason = item
    key = _breaker_key(provider, model, machine, where)
    try:
        return key, TripReason(reason)
    except ValueError:
        raise MemoryFormatError(f"{where}: the reason is not one rolegate knows") from None


def _breaker_key(provider: Any, model: Any, machine: Any, where: str) -> BreakerKey:
    key = BreakerKey(
        _name(provider, where),
        None if model is None else _name(model, where),
        None if machine is None else _name(machine, where),
    )
    if key.model is None and key.machine is not None:
        raise MemoryFormatError(f"{where}: a machine without its model")
    return key


def _fault(item: Any, where: str) -> FaultMarks:
    if not isinstance(item, list) or len(item) != 5:
        raise MemoryFormatError(f"{where} is not a list of 5")
    provider, model, machine, signature, ages = item
    key = _breaker_key(provider, model, machine, where)
    if not isinstance(ages, list) or not 0 < len(ages) <= MAX_MARKS:
        raise MemoryFormatError(f"{where}: ages is not a list of 1 to {MAX_MARKS}")
    if not all(_number(age) and 0 <= age <= MAX_FAULT_AGE_SECONDS for age in ages):
        raise MemoryFormatError(
            f"{where}: an age is not a number of seconds up to {MAX_FAULT_AGE_SECONDS:g}"
        )
    return FaultMarks(key, _name(signature, where), tuple(float(age) for age in ages))


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _read_score(value: Any, where: str) -> ScoreEvidence:
    if not isinstance(value, list) or len(value) != 3:
        raise MemoryFormatError(f"{where} is not [observations, mean, weight]")
    n, mean, weight = value
    if not (_count(n) and n > 0 and _number(mean) and _number(weight)):
        raise MemoryFormatError(f"{where} is not [observations, mean, weight]")
    # An observation is worth 0 to 1 (score.observation_value), so is their mean.
    if not 0.0 <= mean <= 1.0:
        raise MemoryFormatError(f"{where} is out of range: its mean is not in [0, 1]")
    # A running score's total weight is 1 after its first observation and grows by less
    # than 1 with each next one: at least 1, at most its count.
    if not within(weight, 1.0, float(n)):
        raise MemoryFormatError(
            f"{where} is out of range: its weight is not between 1 and its observations"
        )
    return ScoreEvidence(n, float(mean), float(weight))


def _read_evidence(value: Any, where: str, durations: LogRange) -> Evidence | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3 or not all(_number(x) for x in value):
        raise MemoryFormatError(f"{where} is not [n, sum, sum of squares]")
    n, s1, s2 = (float(x) for x in value)
    fault = evidence_fault(n, s1, s2, durations)
    if fault is not None:
        raise MemoryFormatError(f"{where} is out of range: {fault}")
    return Evidence(n, s1, s2)


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise MemoryFormatError(f"{where}: a name is not a string of 1 to {MAX_NAME_CHARS}")
    if not value.isprintable():
        raise MemoryFormatError(f"{where}: a name has unprintable characters")
    return value
