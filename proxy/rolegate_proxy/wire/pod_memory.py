"""The wire format of a pod's memory (core/fleet.PodMemory): compact JSON, versioned,
bounded, and read as untrusted input.

    {"format": 1, "pod": "rolegate-proxy-7d9f-abcde", "writtenAt": 1764763200.0,
     "machines": [["openrouter", "qwen/qwen3-coder", "deepinfra", 42,
                   [8.1, -3.2, 1.9], [8.0, -24.6, 76.1], [42, 0.97619, 25.3]], ...]}

Each machine is `[provider, model, machine, sightings, ttft, gap, score]`: `ttft` and
`gap` are `[n, sum of logs, sum of squared logs]` (the ledger's evidence), `score` is
`[observations, smoothed mean, weight]` (the operational score's record); each null when
there is none. Numbers are kept to six significant digits. About 130 bytes a machine with
typical names: 1,000 machines are ~130 KB, well inside etcd's 1.5 MiB object limit and a
file written in a millisecond.

A memory that does not parse, names a newer format, or breaks a bound is refused whole
(`MemoryFormatError`): a pod starts cold rather than from a half-read memory.
"""

from __future__ import annotations

import math
from typing import Any, Final, TypeGuard

import orjson

from rolegate_policy.model import MAX_MEMORY_MACHINES

from ..core.beliefs import Evidence, MachineEvidence, MachineKey
from ..core.fleet import PodMemory
from ..core.score import ScoreEvidence

FORMAT: Final = 1
# Machines a memory may hold: the ledger's own bound, and the ProxyMemory kind's.
MAX_MACHINES: Final = MAX_MEMORY_MACHINES
MAX_NAME_CHARS: Final = 253
# No pseudo-count is larger than the ledger's cap; this bound only refuses nonsense.
MAX_COUNT: Final = 1e9


class MemoryFormatError(ValueError):
    """A memory that cannot be taken in. The message names what is wrong, never quotes
    the memory (it came from outside the process)."""


def encode(memory: PodMemory) -> bytes:
    rows: dict[MachineKey, list[Any]] = {}
    for item in memory.machines:
        row = rows.setdefault(item.key, [*item.key, 0, None, None, None])
        row[3:6] = [item.sightings, _evidence(item.ttft), _evidence(item.gap)]
    for key, score in memory.scores:
        row = rows.setdefault(key, [*key, 0, None, None, None])
        row[6] = [score.n, _short(score.mean), _short(score.weight)]
    return orjson.dumps(
        {
            "format": FORMAT,
            "pod": memory.pod,
            "writtenAt": round(memory.written_at, 3),
            "machines": list(rows.values())[:MAX_MACHINES],
        }
    )


def machine_count(memory: PodMemory) -> int:
    """The machines `encode` writes a row for (those with evidence, a score or both)."""
    keys = {item.key for item in memory.machines} | {key for key, _ in memory.scores}
    return min(len(keys), MAX_MACHINES)


def _evidence(evidence: Evidence | None) -> list[float] | None:
    if evidence is None:
        return None
    return [_short(evidence.n), _short(evidence.s1), _short(evidence.s2)]


def _short(x: float) -> float:
    return float(f"{x:.6g}")


def decode(data: bytes) -> PodMemory:
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
    evidence: list[MachineEvidence] = []
    scores: list[tuple[MachineKey, ScoreEvidence]] = []
    for index, item in enumerate(machines):
        where = f"machines[{index}]"
        if not isinstance(item, list) or len(item) != 7:
            raise MemoryFormatError(f"{where} is not a list of 7")
        provider, model, machine, sightings, ttft, gap, score = item
        key = MachineKey(_name(provider, where), _name(model, where), _name(machine, where))
        if not _count(sightings):
            raise MemoryFormatError(f"{where}: sightings is not a count")
        beliefs = (_read_evidence(ttft, f"{where}: ttft"), _read_evidence(gap, f"{where}: gap"))
        if beliefs != (None, None):
            evidence.append(MachineEvidence(key, *beliefs, sightings))
        if score is not None:
            scores.append((key, _read_score(score, f"{where}: score")))
    return PodMemory(
        _name(document.get("pod"), "pod"), float(written_at), tuple(evidence), tuple(scores)
    )


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _read_score(value: Any, where: str) -> ScoreEvidence:
    if not isinstance(value, list) or len(value) != 3:
        raise MemoryFormatError(f"{where} is not [observations, mean, weight]")
    n, mean, weight = value
    if not (_count(n) and n > 0 and _number(mean) and _number(weight)):
        raise MemoryFormatError(f"{where} is not [observations, mean, weight]")
    if not (0.0 <= mean <= 1.0 and 0.0 < weight <= n):
        raise MemoryFormatError(f"{where} is out of range")
    return ScoreEvidence(n, float(mean), float(weight))


def _read_evidence(value: Any, where: str) -> Evidence | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3 or not all(_number(x) for x in value):
        raise MemoryFormatError(f"{where} is not [n, sum, sum of squares]")
    n, s1, s2 = (float(x) for x in value)
    if not 0 < n <= MAX_COUNT or s2 < 0:
        raise MemoryFormatError(f"{where} is out of range")
    return Evidence(n, s1, s2)


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise MemoryFormatError(f"{where}: a name is not a string of 1 to {MAX_NAME_CHARS}")
    if not value.isprintable():
        raise MemoryFormatError(f"{where}: a name has unprintable characters")
    return value
