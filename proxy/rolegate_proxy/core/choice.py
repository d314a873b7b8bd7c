"""What a routing decision says: each machine's fate and why, one candidate's choice, a
request's plan, and one candidate's ranking before a request's own touches (SPEC B1-B4).

The chooser (core/chooser.py) makes these; the request path, the decision log and the
rate test read them. Pure data and the reads on it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from rolegate_policy.config import CompiledRole
from rolegate_policy.enums import Ruling

from .beliefs import MachineBelief, MachineKey
from .exclusions import Exclusion
from .fastest import contenders
from .ranking import describe_place
from .routing import MachineRouting, RoutingKind, aggregator_routing
from .score import ScoreView

AFFINITY: Final = "affinity"


class Fate(StrEnum):
    ADMITTED = "admitted"
    # Refused: expected time to a usable answer beyond the role's patience.
    PATIENCE = "patience"
    # Refused: a breaker or a hard exclusion (rate limit, auth, quota).
    EXCLUDED = "excluded"
    # Refused: it already failed in this request.
    FAILED = "failed"


# The key of a fate that was never ranked (see MachineFate.key).
_NO_KEY: Final = MachineKey("", "", "")


@dataclass(slots=True)
class MachineFate:
    """One machine of a candidate, what became of it and why (for the decision log).

    `reason` is one word: for an admitted machine `affinity` (it leads by the pin),
    `believed` or `unknown` (no belief); for a refused one `patience`, `failed` or the
    exclusion's reason (`UpstreamErrors`, `RateLimited`, ...). `detail` is for a person.

    Built for every machine of every routing decision, so it is a plain slotted object
    (its choice owns it) and an admitted machine's `detail` is written only when read."""

    machine: str
    fate: Fate
    reason: str
    # Why, for a refused machine; None for an admitted one (see `detail`).
    note: str | None
    expected_seconds: float | None = None
    # Named in the ProviderPolicy (False: known only from sightings).
    on_sheet: bool = True
    continues_partial: bool = False
    exclusion: Exclusion | None = None
    belief: MachineBelief | None = field(default=None, repr=False, compare=False)
    # The role's figures an admitted machine was measured against.
    tokens: int = 0
    patience: float = 0.0
    # Where the ranking placed an admitted machine (None when it was the only one).
    # (tier, behind the best, semantic demotion, slow): not the Placed itself, which refers
    # back to this fate (a reference cycle per machine per decision keeps the collector busy).
    placement: tuple[int, float, bool, bool] | None = field(default=None, compare=False)
    # What the ranking reads (see ranking.Rankable), filled in for admitted machines.
    key: MachineKey = field(default=_NO_KEY, compare=False, repr=False)
    score: float = 0.5
    semantic: float | None = None
    cost: float | None = None
    # Its operational evidence as the scoreboard holds it (shrunk to `score` towards the
    # field's target by the ranking), filled in with `score`.
    view: ScoreView | None = field(default=None, compare=False, repr=False)
    # It leads this once by exploration rather than by rank.
    explored: bool = False
    # The part of `expected_seconds` spent waiting in its queue (SPEC B8; core/load.py).
    queue_seconds: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.fate is Fate.ADMITTED

    @property
    def detail(self) -> str:
        if self.note is not None:
            text = self.note
        elif self.expected_seconds is not None:
            text = (
                f"expected {self.expected_seconds:.1f} s for {self.tokens} tokens, "
                f"within {self.patience:g} s"
            )
        else:
            text = "no belief yet: admitted, ranked last"
        if self.queue_seconds > 0:
            text = f"{text} (of which {self.queue_seconds:.1f} s in its queue)"
        if self.placement is not None:
            tier, behind, demoted, slow = self.placement
            place = describe_place(
                tier, behind, demoted, self.cost, self.expected_seconds, slow=slow
            )
            text = f"{text}; {place}"
        if self.reason == AFFINITY:
            text = f"answered last for this role; {text}"
        if self.explored:
            text = f"explored (leads this once, so its score stays current); {text}"
        return text

    @property
    def expected_ttft(self) -> float | None:
        return None if self.belief is None else self.belief.expected_ttft

    @property
    def expected_rate(self) -> float | None:
        return None if self.belief is None else self.belief.expected_rate


def by_expected_time(fate: MachineFate) -> float:
    """The default rank: expected time to a usable answer; a machine without one last."""
    return math.inf if fate.expected_seconds is None else fate.expected_seconds


@dataclass(frozen=True, slots=True)
class Alternative:
    """A machine the request could move to (SPEC B5, B6): its belief, and whether it can
    continue a partial assistant message (so it can take over after content reached the
    client). Only machines with both a TTFT and a gap belief are alternatives."""

    key: MachineKey
    belief: MachineBelief
    continues_partial: bool = False
    # Read once from the belief (a watch asks on every token).
    expected_ttft: float = field(init=False, compare=False)
    expected_gap: float = field(init=False, compare=False)

    def __post_init__(self) -> None:
        ttft, gap = self.belief.expected_ttft, self.belief.expected_gap
        if ttft is None or gap is None:
            raise ValueError(f"{self.key.describe()}: an alternative needs a TTFT and a gap belief")
        object.__setattr__(self, "expected_ttft", ttft)
        object.__setattr__(self, "expected_gap", gap)

    def expected_seconds(self, tokens: float) -> float:
        """Switching cost plus the rest: expected TTFT + tokens x expected gap."""
        return self.expected_ttft + max(tokens, 0.0) * self.expected_gap


@dataclass(frozen=True, slots=True)
class Choice:
    """One candidate of a request: every machine's fate, and what to send.

    `routing` is what to ask of an aggregator (None for a direct provider, or when
    the candidate is skipped). `skip_reason` says why nothing is sent to this candidate
    (None: send). `ruling` is the ruling the routing follows. `pinned` names the machine
    leading by affinity. `last_resort` marks the relaxed choice of `Plan.last_resort()`.
    `target` is the operational score the ranking shrank its machines towards (None when
    fewer than two were admitted, so nothing was ranked)."""

    role: str
    provider: str
    model: str
    aggregator: bool
    ruling: Ruling
    fates: tuple[MachineFate, ...]
    routing: MachineRouting | None = field(default=None, compare=False)
    skip_reason: str | None = None
    pinned: str | None = None
    last_resort: bool = False
    target: float | None = None
    # The ranking this choice was finished from (it keeps the contenders once found).
    ranked: Ranked | None = field(default=None, compare=False, repr=False)

    @property
    def sendable(self) -> bool:
        return self.skip_reason is None

    def contenders(self) -> list[Alternative]:
        """The admitted machines with a complete belief that can finish a stream soonest
        for some length, even with any one of them left out (`fastest.contenders`)."""
        if self.ranked is not None:
            return self.ranked.contenders(self)
        return contenders_of(_alternatives(self, self.fates))

    @property
    def admitted(self) -> tuple[str, ...]:
        """The admitted machines, in rank order (the pinned one first)."""
        return tuple(f.machine for f in self.fates if f.admitted)

    @property
    def refused(self) -> tuple[str, ...]:
        return tuple(f.machine for f in self.fates if not f.admitted)

    def fate(self, machine: str) -> MachineFate | None:
        for fate in self.fates:
            if fate.machine == machine:
                return fate
        return None

    def key(self, machine: str) -> MachineKey:
        return MachineKey(self.provider, self.model, machine)

    def describe(self) -> str:
        """One line for the decision log."""
        head = f"{self.provider}/{self.model} ruling={self.ruling.value}"
        if self.skip_reason is not None:
            head += f" skipped: {self.skip_reason}"
        parts = [f"{f.machine}={f.fate.value}({f.reason})" for f in self.fates]
        return head + ("; " + ", ".join(parts) if parts else "")

    def relaxed(self) -> Choice | None:
        """When nothing was admitted: an `order` of the machines refused only for patience
        (ranked by expected time, every other refused machine in `ignore`, fallbacks
        allowed), or None when every machine is hard-excluded or failed."""
        if self.admitted:
            return None
        slow = sorted(
            (f for f in self.fates if f.fate is Fate.PATIENCE),
            key=lambda f: (by_expected_time(f), f.machine),
        )
        if not slow:
            return None
        others = tuple(f for f in self.fates if f.fate is not Fate.PATIENCE)
        routing: MachineRouting | None = None
        if self.aggregator:
            routing = MachineRouting(
                RoutingKind.ORDER,
                tuple(f.machine for f in slow),
                tuple(f.machine for f in others),
            )
        return Choice(
            self.role,
            self.provider,
            self.model,
            self.aggregator,
            Ruling.ORDER,
            (*slow, *others),
            routing,
            None,
            None,
            last_resort=True,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """Every candidate of a request, in the role's order."""

    role: str
    choices: tuple[Choice, ...]
    # The affinity pin this plan dropped because its machine is refused now.
    unpinned: MachineKey | None = None

    def sendable(self) -> tuple[Choice, ...]:
        return tuple(c for c in self.choices if c.sendable)

    def frontier(self) -> tuple[Alternative, ...]:
        """What the mid-stream rate test may compare a serving machine with: of every
        admitted machine with a complete belief, in plan order, those that can finish some
        remaining length soonest with any one machine left out, among them all and among
        those that continue partial messages (`Choice.contenders`). The test's answer is the
        same as over all of them; over a thousand machines it is a handful."""
        found: list[Alternative] = []
        for choice in self.choices:
            found.extend(choice.contenders())
        return tuple(found)

    def continuers(self, model: str, avoid: Collection[MachineKey] = ()) -> list[MachineKey]:
        """The admitted machines that continue a partial assistant message, to take over
        an answer of `model` that broke after content reached the client (SPEC E5): that
        model's first, then the role's other models in order; `avoid` left out."""
        same: list[MachineKey] = []
        others: list[MachineKey] = []
        for choice in self.choices:
            for fate in choice.fates:
                if not (fate.admitted and fate.continues_partial):
                    continue
                key = choice.key(fate.machine)
                if key not in avoid:
                    (same if choice.model == model else others).append(key)
        return same + others

    def last_resort(self) -> Choice | None:
        """None while any candidate is sendable; otherwise the first candidate whose
        machines were refused only for patience, relaxed into an `order` (B4: an empty
        admitted set falls back to `order`, never to an empty `only`)."""
        if self.sendable():
            return None
        for choice in self.choices:
            relaxed = choice.relaxed()
            if relaxed is not None:
                return relaxed
        return None


class Ranked:
    """One candidate's machines judged and ranked, before any request's own touches: the
    admitted in rank order, the refused in refusal order. A standing keeps one between
    requests (`Chooser._standing`); what requests read of it is built once, when first
    read."""

    __slots__ = (
        "_choice",
        "_contenders",
        "_heads",
        "_positions",
        "_refused_names",
        "admitted",
        "aggregator",
        "model",
        "prompt_tokens",
        "provider",
        "refused",
        "role",
        "target",
        "until",
    )

    def __init__(
        self,
        role: CompiledRole,
        provider: str,
        model: str,
        aggregator: bool,
        admitted: list[MachineFate],
        refused: list[MachineFate],
        target: float | None,
        prompt_tokens: int,
    ) -> None:
        self.role = role
        self.provider = provider
        self.model = model
        self.aggregator = aggregator
        self.admitted = admitted
        self.refused = refused
        self.target = target
        # The prompt size its costs were computed for.
        self.prompt_tokens = prompt_tokens
        # Until when a standing keeps it (see `Chooser._standing`; inf when not kept).
        self.until = math.inf
        self._choice: Choice | None = None
        self._heads: dict[str, MachineFate] = {}
        self._positions: dict[str, int] | None = None
        self._refused_names: frozenset[str] | None = None
        self._contenders: list[Alternative] | None = None

    @property
    def choice(self) -> Choice:
        """The choice with nothing of a request's own: rank order as it stands."""
        if self._choice is None:
            self._choice = self.finished(self.admitted, None)
        return self._choice

    def finished(self, admitted: Sequence[MachineFate], pinned: str | None) -> Choice:
        """The choice that sends `admitted` (these machines, reordered) in this order."""
        role, refused = self.role, self.refused
        ruling = Ruling.ONLY if role.effective_ruling is Ruling.ONLY else Ruling.ORDER
        ordered = (*admitted, *refused)
        if not admitted:
            reasons = ", ".join(f"{f.machine}: {f.reason}" for f in refused) or "none listed"
            return Choice(
                role.name, self.provider, self.model, self.aggregator, ruling, ordered, None,
                f"no machine of this model may be sent to ({reasons})", None, ranked=self,
            )  # fmt: skip
        routing = None
        if self.aggregator:
            routing = aggregator_routing(
                role, [f.machine for f in admitted], [f.machine for f in refused]
            )
        return Choice(
            role.name, self.provider, self.model, self.aggregator, ruling, ordered, routing, None,
            pinned, target=self.target, ranked=self,
        )  # fmt: skip

    def head(self, fate: MachineFate) -> MachineFate:
        """A copy of an admitted machine's fate to rank against other providers' heads
        (`Chooser.order_candidates` scores it anew for that field), one per machine."""
        found = self._heads.get(fate.machine)
        if found is None:
            found = self._heads[fate.machine] = copy.copy(fate)
            found.cost = None
            found.view = None
        return found

    def position(self, machine: str) -> int | None:
        """Where `machine` stands among the admitted (None: not admitted)."""
        if self._positions is None:
            self._positions = {f.machine: i for i, f in enumerate(self.admitted)}
        return self._positions.get(machine)

    def refused_names(self) -> frozenset[str]:
        if self._refused_names is None:
            self._refused_names = frozenset(f.machine for f in self.refused)
        return self._refused_names

    def contenders(self, choice: Choice) -> list[Alternative]:
        """`Choice.contenders` of this ranking (the same for every request finished from
        it: a request reorders the admitted, never changes them)."""
        if self._contenders is None:
            self._contenders = contenders_of(_alternatives(choice, self.admitted))
        return self._contenders


def _alternatives(choice: Choice, fates: Sequence[MachineFate]) -> list[Alternative]:
    """The admitted machines with both a TTFT and a gap belief, in order."""
    found: list[Alternative] = []
    for fate in fates:
        belief = fate.belief
        if not fate.admitted or belief is None or belief.ttft is None or belief.gap is None:
            continue
        found.append(Alternative(choice.key(fate.machine), belief, fate.continues_partial))
    return found


def contenders_of(alternatives: list[Alternative]) -> list[Alternative]:
    """`fastest.contenders` among all and among those that continue partial messages
    (what the watch compares once content reached the client), in their order."""
    keep = {id(a) for a in contenders(alternatives)}
    continuing = [a for a in alternatives if a.continues_partial]
    if continuing:
        keep.update(id(a) for a in contenders(continuing))
    return [a for a in alternatives if id(a) in keep]
