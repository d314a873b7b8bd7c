"""Which machines a request may go to, in what order, and why (SPEC B1-B4).

For a request in a role, each candidate (a model of the role on a provider serving it, in
the role's order) gets a `Choice`: every machine of that (provider, model) that the
ProviderPolicy names or the ledger knows about, each with its fate and the reason.

* **Refusal (B1).** A machine whose expected time to a usable answer (expected TTFT plus
  the role's expected output tokens times the expected gap, from its belief) exceeds the
  role's patience is refused with reason `patience`. A machine whose TTFT alone is
  expected past the patience is refused too, even when its rate is unknown. A hard
  exclusion (breaker, rate limit, auth, quota) refuses with the exclusion's reason; a
  machine that already failed in this request is refused with reason `failed`.
* **Ranking (C4, C5).** The admitted machines are ranked by `ranking.rank`: quality first
  (the shrunk operational score, in dithered tiers of the role's quality tolerance), then
  the semantic score as a demotion only, then expected cost, then expected time (an
  unknown machine last). The score only orders what was admitted: it never refuses a
  machine, and no score brings back one a breaker or an exclusion refused. Candidates
  serving the same model on different providers are ordered the same way
  (`order_candidates`); the role's model order stays the caller's.
* **Cold start (C2, G3).** Each ranking shrinks the operational evidence of what it ranks
  towards that field's own target (`score.field_target`: the confidence-weighted mean of
  the observed means, computed here once per ranking), not towards the scale's midpoint.
  An untried machine scores the target: beside one machine with a record it ties with it
  on quality, and its published figures (cost, then expected time) decide whether it is
  tried first; among several it sits at the field's mean.
* **Exploration (C4, G3).** In a share of the role's decisions (its `explorationShare`,
  else the proxy's `explore`) a machine other than the best leads: the one with the least
  evidence (lowest confidence), then the longest unobserved, then the best ranked. So an
  untried machine is observed first and a demoted one is looked at again in turn, which
  a uniform draw would do only by chance.
* **Affinity (B3).** The machine that last answered for the role leads its candidate's
  order unless it is refused now, and a refused machine loses the pin. So does one that
  fell out of the top quality tier: the score lowers preference, the pin must not
  outlive that.
* **Unknown machines (B2).** Machines known only from the ledger (an aggregator routed to
  them unasked) are candidates, and refusable by name, like those on the sheet.
* **Ruling (B4).** An aggregator gets `order` + `ignore` (every refused machine) +
  `allow_fallbacks: true`, or `only` of the admitted machines with `allow_fallbacks:
  false`, following the role's effective ruling (`Auto` is resolved at compile time). An
  empty admitted set is never an empty `only`: the candidate is skipped with a reason.
  When no candidate of the request has an admitted machine, `Plan.last_resort()` offers
  the best candidate whose machines were refused only for patience as an `order` of them
  (a slow answer beats none); hard exclusions are never sent to.

* **Kept rankings.** With the breakers' epoch, a candidate's ranking is kept between
  requests until what it was made from changes (`_standing`), and each request applies
  its own pin, exploration and failures to it: a decision over a thousand machines costs
  what one over a single machine does.

Pure: the clock and the exclusion lookup are arguments; nothing here sends anything.
See docs/patience.md.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from rolegate_policy.config import (
    CompiledMachine,
    CompiledModel,
    CompiledRole,
)
from rolegate_policy.enums import (
    Ruling,
)

from .beliefs import (
    BELIEF_COALESCE_SECONDS,
    BELIEF_REFRESH_SECONDS,
    Ledger,
    MachineBelief,
    MachineKey,
)
from .exclusions import (
    Exclusion,
)
from .fastest import contenders
from .ranking import describe_place, rank
from .routing import Candidate, MachineRouting, RoutingKind, aggregator_routing
from .score import UNIT_SCALE, Scoreboard, ScoreView

# (provider, model, machine or None for a direct provider, now) -> why it may not be sent
# to. `Breakers.exclusion` is one: a read that changes nothing.
ExclusionLookup = Callable[[str, str, str | None, float], Exclusion | None]

PATIENCE: Final = "patience"
FAILED: Final = "failed"
AFFINITY: Final = "affinity"
# Roles whose affinity pin is remembered at most (roles come from the RoleTable).
MAX_PINS: Final = 1024
# Standings kept at most (role x candidate x prompt-size class; see `Chooser._standing`).
MAX_STANDINGS: Final = 4096
# Machines of a model known only from sightings (an aggregator named them) that routing
# considers, and so names in the routing field: the most recently sighted ones.
MAX_LEARNED_MACHINES: Final = 64


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
    # (tier, behind the best, semantic demotion): not the Placed itself, which refers back
    # to this fate (a reference cycle per machine per decision keeps the collector busy).
    placement: tuple[int, float, bool] | None = field(default=None, compare=False)
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
        if self.placement is not None:
            tier, behind, demoted = self.placement
            place = describe_place(tier, behind, demoted, self.cost, self.expected_seconds)
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
        return _contenders_of(_alternatives(self, self.fates))

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
            self._contenders = _contenders_of(_alternatives(choice, self.admitted))
        return self._contenders


@dataclass(frozen=True, slots=True)
class _Standing:
    """A ranking kept between requests, and what it was made from (`Chooser._standing`)."""

    role: CompiledRole
    model: CompiledModel
    epoch: int
    beliefs: int
    scores: int
    known: int
    made_at: float
    until: float
    ranked: Ranked


@dataclass(frozen=True, slots=True)
class _KeptFrontier:
    """A role's frontier kept between requests (`Chooser.frontier`)."""

    role: CompiledRole
    candidates: Sequence[Candidate]
    epoch: int
    counts: tuple[int, int]
    made_at: float
    until: float
    frontier: tuple[Alternative, ...]


class Chooser:
    """Plans requests from the ledger's beliefs and the breakers' exclusions, and holds
    each role's affinity pin. Pure; `now` is passed in. Not thread-safe."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        scores: Scoreboard | None = None,
        draw: Callable[[], float] | None = None,
        explore: float = 0.0,
        exclusions_epoch: Callable[[], int] | None = None,
    ) -> None:
        if not 0.0 <= explore < 1.0:
            raise ValueError(f"the exploration share must be in [0, 1), got {explore}")
        self.ledger = ledger
        # The share of decisions in which a machine other than the best leads, for a role
        # that declares no `explorationShare` of its own (see `_exploring`); 0 in the pure
        # tests, ProxySettings.explore_share in the proxy.
        self.explore = explore
        self.scores = scores if scores is not None else Scoreboard()
        # Uniform on [0, 1): the dither of the quality tiers. Tests pass a seeded one.
        self.draw = draw if draw is not None else random.Random().random
        self._pins: dict[str, MachineKey] = {}
        # The breakers' epoch (`Breakers.epoch`), whose every change can change what the
        # exclusion lookup answers: with it, rankings are kept between requests
        # (`_standing`); without it (the pure tests' lookups), every decision ranks afresh.
        self._exclusions_epoch = exclusions_epoch
        self._standings: dict[tuple[str, str, str, int], _Standing] = {}
        self._frontiers: dict[str, _KeptFrontier] = {}
        # id(compiled model) -> (the model, its machines by name, their names in order).
        self._sheets: dict[
            int,
            tuple[CompiledModel, dict[str, CompiledMachine], list[str], dict[str, MachineKey]],
        ] = {}

    # -- affinity -------------------------------------------------------------------------

    def answered(self, role: str, key: MachineKey) -> None:
        """The machine `key` answered for `role`: it leads that role's next order."""
        self._pins.pop(role, None)
        self._pins[role] = key
        while len(self._pins) > MAX_PINS:
            del self._pins[next(iter(self._pins))]

    def pinned(self, role: str) -> MachineKey | None:
        return self._pins.get(role)

    # -- planning -------------------------------------------------------------------------

    def plan(
        self,
        role: CompiledRole,
        candidates: Sequence[Candidate],
        exclusion: ExclusionLookup,
        now: float,
        *,
        avoid: Collection[MachineKey] = (),
        prompt_tokens: int = 0,
    ) -> Plan:
        """Every candidate's choice, in order. `avoid`: machines that failed earlier in
        this request."""
        unpinned: MachineKey | None = None
        choices: list[Choice] = []
        for candidate in candidates:
            pin = self._pins.get(role.name)
            choices.append(
                self.choose(
                    role, candidate, exclusion, now, avoid=avoid, prompt_tokens=prompt_tokens
                )
            )
            if pin is not None and self._pins.get(role.name) is None:
                unpinned = pin
        return Plan(role.name, tuple(choices), unpinned)

    def frontier(
        self,
        role: CompiledRole,
        candidates: Sequence[Candidate],
        exclusion: ExclusionLookup,
        now: float,
    ) -> tuple[Alternative, ...]:
        """What a stream's rate test compares its machine with: the plan's frontier cut to
        the machines that can win over the whole request (`fastest.contenders`, among all
        and among continuers). With an `exclusions_epoch` it is kept per role as rankings
        are (`_standing`): every stream asks, and over a thousand machines the plan behind
        it is sixteen candidates' rankings."""
        epoch = None if self._exclusions_epoch is None else self._exclusions_epoch()
        counts = (self.ledger.versions.count, self.scores.versions.count)
        held = self._frontiers.get(role.name)
        if (
            epoch is not None
            and held is not None
            and held.role is role
            and held.candidates is candidates
            and held.epoch == epoch
            and _kept(held.made_at, held.until, held.counts == counts, now)
        ):
            return held.frontier
        plan = self.plan(role, candidates, exclusion, now)
        frontier = tuple(_contenders_of(list(plan.frontier())))
        if epoch is not None:
            until = min(
                (c.ranked.until for c in plan.choices if c.ranked is not None),
                default=now + BELIEF_REFRESH_SECONDS,
            )
            if len(self._frontiers) >= MAX_PINS:
                self._frontiers.clear()
            self._frontiers[role.name] = _KeptFrontier(
                role, candidates, epoch, counts, now, until, frontier
            )
        return frontier

    def choose(
        self,
        role: CompiledRole,
        candidate: Candidate,
        exclusion: ExclusionLookup,
        now: float,
        *,
        avoid: Collection[MachineKey] | Collection[str] = (),
        prompt_tokens: int = 0,
    ) -> Choice:
        """One candidate's choice. `avoid` names machines that failed earlier in this
        request (MachineKeys, or bare machine names of this candidate); `prompt_tokens`
        is the request's estimated input, for the expected cost.

        With an `exclusions_epoch`, a candidate's ranking is kept between requests while
        nothing it was computed from changed (`_standing`); this request's own touches
        (the affinity pin, an exploration, the machines it saw fail) are applied to it."""
        if avoid:
            ranked = self._ranked(role, candidate, exclusion, now, avoid, prompt_tokens)
        else:
            ranked = self._ranking(role, candidate, exclusion, now, prompt_tokens)
        return self._finish(role, candidate, ranked)

    def _ranking(
        self,
        role: CompiledRole,
        candidate: Candidate,
        exclusion: ExclusionLookup,
        now: float,
        prompt_tokens: int,
    ) -> Ranked:
        """The candidate's ranking: kept (`_standing`) when rankings may be kept."""
        if self._exclusions_epoch is None:
            return self._ranked(role, candidate, exclusion, now, (), prompt_tokens)
        return self._standing(role, candidate, exclusion, now, prompt_tokens)

    def _standing(
        self,
        role: CompiledRole,
        candidate: Candidate,
        exclusion: ExclusionLookup,
        now: float,
        prompt_tokens: int,
    ) -> Ranked:
        """The candidate's ranking, kept per role, candidate and prompt-size class while:
        the configuration is the same; the breakers' exclusions did not change (any change
        is seen at once) and none it saw has ended; and the ledger's beliefs and the
        scoreboard's scores did not change, or changed less than BELIEF_COALESCE_SECONDS
        after it was made (the ledger already serves a sighting that late); for at most
        BELIEF_REFRESH_SECONDS (the beliefs' own forgetting). So a routing decision costs
        the same over a thousand machines as over one, and a candidate answering a
        thousand requests a second is ranked twenty times a second, not a thousand.

        The quality tiers' dither is drawn per ranking, so it is kept with it: the share of
        first attempts a machine behind the best gets holds over the rankings, not within
        one. Costs are compared at the prompt-size class (`prompt_tokens` rounded within
        its power of two)."""
        provider, model = candidate.provider.name, candidate.model.name
        size = prompt_tokens.bit_length()
        key = (role.name, provider, model, size)
        assert self._exclusions_epoch is not None
        epoch = self._exclusions_epoch()
        beliefs = self.ledger.versions.of(provider, model)
        scores = self.scores.versions.of(provider, model)
        # A machine first heard of (an aggregator routed to it unasked) is a candidate at
        # once, as the ledger knows it from its first sighting on: never coalesced.
        known = len(self.ledger.machine_set(provider, model))
        held = self._standings.get(key)
        if (
            held is not None
            and held.role is role
            and held.model is candidate.model
            and held.epoch == epoch
            and held.known == known
            and _kept(
                held.made_at, held.until, held.beliefs == beliefs and held.scores == scores, now
            )
        ):
            return held.ranked
        ranked = self._ranked(role, candidate, exclusion, now, (), _size_class_tokens(size))
        until = now + BELIEF_REFRESH_SECONDS
        for fate in ranked.refused:
            if fate.exclusion is not None and fate.exclusion.until is not None:
                until = min(until, fate.exclusion.until)
        # A sighting filed moments ago may have been read as the belief before it (the
        # ledger coalesces): look again once it is served.
        served_at = self.ledger.versions.changed_at(provider, model) + BELIEF_COALESCE_SECONDS
        if served_at > now:
            until = min(until, served_at)
        ranked.until = until
        if len(self._standings) >= MAX_STANDINGS:
            self._standings.clear()
        self._standings[key] = _Standing(
            role, candidate.model, epoch, beliefs, scores, known, now, until, ranked
        )
        return ranked

    def _ranked(
        self,
        role: CompiledRole,
        candidate: Candidate,
        exclusion: ExclusionLookup,
        now: float,
        avoid: Collection[MachineKey] | Collection[str],
        prompt_tokens: int,
    ) -> Ranked:
        """Every machine of the candidate judged and the admitted ranked, before this
        request's own touches (see `_finish`)."""
        provider, model = candidate.provider.name, candidate.model.name
        aggregator = candidate.is_aggregator
        sheet, sheet_names, keys = self._sheet(candidate)
        if aggregator:
            learned = self.ledger.machine_set(provider, model)
            if learned <= sheet.keys():
                names = sheet_names
            elif len(learned) - len(sheet) <= MAX_LEARNED_MACHINES:
                names = sorted(sheet.keys() | learned)
            else:
                # An aggregator may name machines without end (or invent them): those it
                # named most recently are what it routes to now, and the routing field sent
                # back to it stays bounded (SPEC E8).
                recent = self.ledger.recent_machines(
                    provider, model, MAX_LEARNED_MACHINES, sheet.keys()
                )
                names = sorted(sheet.keys() | set(recent))
        else:
            names = sheet_names[:1]
        failed = _names(avoid, provider, model) if avoid else _NO_NAMES
        tokens = role.expected_output_tokens
        patience = role.patience_seconds
        belief_of = self.ledger.current

        # The hot loop of routing: every machine of the candidate, every ranking.
        fates: list[MachineFate] = []
        admitted: list[MachineFate] = []
        # Enum members bound once: a class attribute read per machine adds up here.
        admit, fail, exclude, wait = Fate.ADMITTED, Fate.FAILED, Fate.EXCLUDED, Fate.PATIENCE
        for name in names:
            key = keys.get(name) or MachineKey(provider, model, name)
            belief = belief_of(key, now)
            expected = None if belief is None else belief.expected_seconds(tokens)
            compiled = sheet.get(name)
            on_sheet = compiled is not None
            continues = compiled is not None and compiled.continues_partial_message
            excluded = exclusion(provider, model, name if aggregator else None, now)
            if name in failed:
                fate = MachineFate(name, fail, FAILED, "failed earlier in this request",
                                   expected, on_sheet, continues, None, belief)  # fmt: skip
            elif excluded is not None:
                fate = MachineFate(name, exclude, excluded.reason.value,
                                   excluded.describe(), expected, on_sheet, continues, excluded,
                                   belief)  # fmt: skip
            elif (expected is None or expected > patience) and (
                why := _beyond_patience(belief, expected, tokens, patience)
            ) is not None:
                fate = MachineFate(name, wait, PATIENCE, why, expected, on_sheet,
                                   continues, None, belief)  # fmt: skip
            else:
                fate = MachineFate(name, admit,
                                   "believed" if expected is not None else "unknown", None,
                                   expected, on_sheet, continues, None, belief, tokens,
                                   patience, None, key)  # fmt: skip
                admitted.append(fate)
            fates.append(fate)

        target = None
        if len(admitted) > 1:
            admitted, target = self._rank(role, admitted, sheet, prompt_tokens)
        refused = sorted(
            (f for f in fates if f.fate is not admit),
            key=lambda f: (_REFUSAL_ORDER[f.fate], by_expected_time(f), f.machine),
        )
        return Ranked(role, provider, model, aggregator, admitted, refused, target, prompt_tokens)

    def _finish(self, role: CompiledRole, candidate: Candidate, ranked: Ranked) -> Choice:
        """The choice this request makes of a ranking: the affinity pin leads (or is
        dropped), and in an exploring decision the least observed machine leads. The
        ranking itself is left as it was (the fates this touches are copies)."""
        admitted = ranked.admitted
        pinned = self._pin(role.name, ranked)
        explore = self._exploring(role, len(admitted))
        if pinned is None and not explore:
            return ranked.choice
        order = list(admitted)
        pinned_name = None
        if pinned is not None:
            fate = copy.copy(order.pop(pinned))
            fate.reason = AFFINITY
            order.insert(0, fate)
            pinned_name = fate.machine
        if explore:
            explored = copy.copy(order.pop(self._least_observed(order)))
            explored.explored = True
            order.insert(0, explored)
            pinned_name = None
        return ranked.finished(order, pinned_name)

    def _rank(
        self,
        role: CompiledRole,
        admitted: list[MachineFate],
        sheet: dict[str, CompiledMachine],
        prompt_tokens: int,
    ) -> tuple[list[MachineFate], float]:
        """Two or more admitted machines in rank order, each with its placement (one alone
        is not ranked, and takes no draw), and the target their scores were shrunk to."""
        target = self._score(role, admitted, sheet, prompt_tokens)
        ranked = []
        for place in rank(admitted, role.quality_tolerance, self.draw):
            fate = place.entry
            fate.placement = (place.tier, place.behind, place.semantic_demoted)
            ranked.append(fate)
        return ranked, target

    def _score(
        self,
        role: CompiledRole,
        fates: Sequence[MachineFate],
        sheet: dict[str, CompiledMachine] | None,
        prompt_tokens: int,
    ) -> float:
        """Fill in what the ranking reads of each machine it ranks: its semantic score, its
        expected cost (from `sheet`; None leaves the cost as it is) and its operational
        score shrunk towards the target of this field of machines, which it returns.

        The target is `score.field_target` and each score `ScoreView.toward(target)`,
        written out in two loops rather than called per machine: this runs for every
        admitted machine of every decision (tests/proxy/test_chooser.py holds the two to
        the same numbers)."""
        evidence_of = self.scores.evidence
        out_tokens = role.expected_output_tokens
        weight = weighted = 0.0
        low, high = math.inf, -math.inf
        for fate in fates:
            view, fate.semantic = evidence_of(fate.key)
            fate.view = view
            observed = view.observed
            if observed is not None:
                confidence = view.confidence
                weight += confidence
                weighted += confidence * observed
                if observed < low:
                    low = observed
                if observed > high:
                    high = observed
            if sheet is None:
                continue
            compiled = sheet.get(fate.machine)
            if compiled is not None:
                price_in = compiled.price_input_per_mtok
                price_out = compiled.price_output_per_mtok
                if price_in is not None and price_out is not None:
                    fate.cost = (prompt_tokens * price_in + out_tokens * price_out) / 1e6
        target = UNIT_SCALE.neutral if weight == 0.0 else min(high, max(low, weighted / weight))
        for fate in fates:
            held = fate.view
            assert held is not None  # read in the loop above
            observed = held.observed
            if observed is None:
                fate.score = target
            elif held.confidence >= 1.0:
                fate.score = observed
            else:
                fate.score = target + held.confidence * (observed - target)
        return target

    def _sheet(
        self, candidate: Candidate
    ) -> tuple[dict[str, CompiledMachine], list[str], dict[str, MachineKey]]:
        """The candidate model's machines by name, their names in order and their keys:
        built once per compiled model (a reload brings new model objects, so new entries)."""
        compiled = candidate.model
        found = self._sheets.get(id(compiled))
        if found is not None and found[0] is compiled:
            return found[1], found[2], found[3]
        sheet = {machine.name: machine for machine in compiled.machines}
        names = sorted(sheet) if candidate.is_aggregator else [m.name for m in compiled.machines]
        keys = {name: MachineKey(candidate.provider.name, compiled.name, name) for name in sheet}
        if len(self._sheets) >= MAX_PINS:
            self._sheets.clear()
        self._sheets[id(compiled)] = (compiled, sheet, names, keys)
        return sheet, names, keys

    def order_candidates(
        self,
        role: CompiledRole,
        candidates: Sequence[Candidate],
        exclusion: ExclusionLookup,
        now: float,
        *,
        prompt_tokens: int = 0,
    ) -> list[Candidate]:
        """The candidates with each model's providers ranked like machines (quality, then
        cost, then time, by the machine each would send to first); the role's model order
        is kept. A candidate with nothing admitted goes after its model's others."""
        models = list(dict.fromkeys(c.model.name for c in candidates))
        if len(models) == len(candidates):
            return list(candidates)
        ordered: list[Candidate] = []
        for model in models:
            group = [c for c in candidates if c.model.name == model]
            if len(group) == 1:
                ordered.extend(group)
                continue
            entries: list[MachineFate] = []
            by_key: dict[MachineKey, Candidate] = {}
            closed: list[Candidate] = []
            for candidate in group:
                ranked = self._ranking(role, candidate, exclusion, now, prompt_tokens)
                if not ranked.admitted:
                    closed.append(candidate)
                    continue
                # Each provider by the machine it would send to first: the pinned one, else
                # its best (exploring among providers is decided below, once).
                pinned = self._pin(role.name, ranked)
                head = ranked.head(ranked.admitted[0 if pinned is None else pinned])
                if head.cost is None and head.view is None:
                    sheet, _, _ = self._sheet(candidate)
                    self._score(role, [head], sheet, ranked.prompt_tokens)  # its cost
                entries.append(head)
                by_key[head.key] = candidate
            # The heads are ranked against each other: shrunk towards their own field.
            self._score(role, entries, None, prompt_tokens)
            heads = [place.entry for place in rank(entries, role.quality_tolerance, self.draw)]
            if self._exploring(role, len(heads)):
                heads.insert(0, heads.pop(self._least_observed(heads)))
            ordered.extend(by_key[head.key] for head in heads)
            ordered.extend(closed)
        return ordered

    def _exploring(self, role: CompiledRole, count: int) -> bool:
        """Whether this decision explores: with probability the role's exploration share
        (its `explorationShare`, else `explore`), when there is more than one to choose
        from (SPEC C4, G3: the score may lower a machine's preference, never shut it out;
        without some traffic a demoted or untried machine's score could never move)."""
        share = self.explore if role.exploration_share is None else role.exploration_share
        return count > 1 and share > 0 and self.draw() < share

    def _least_observed(self, ranked: Sequence[MachineFate]) -> int:
        """The position, other than the first, of the machine to explore: the least
        evidence (lowest confidence: an untried machine first), then the longest since it
        was last observed (full-confidence machines take their turns), then the best
        ranked. Called only for a decision that explores, on scored machines."""
        last_observed = self.scores.last_observed

        def evidence(index: int) -> tuple[float, float, int]:
            fate = ranked[index]
            confidence = 0.0 if fate.view is None else fate.view.confidence
            seen = last_observed(fate.key)
            return (confidence, -math.inf if seen is None else seen, index)

        return min(range(1, len(ranked)), key=evidence)

    def _pin(self, role: str, ranked: Ranked) -> int | None:
        """Where the role's affinity pin stands among the admitted, to lead; None when it
        is on another candidate, or dropped: a refused machine never keeps the pin (B3);
        nor does one the score placed below the top quality tier (C4: the score lowers
        preference)."""
        pin = self._pins.get(role)
        if pin is None or pin.provider != ranked.provider or pin.model != ranked.model:
            return None
        index = ranked.position(pin.machine)
        admitted = ranked.admitted
        if pin.machine in ranked.refused_names() or (
            admitted and (index is None or not _top_tier(admitted[index]))
        ):
            del self._pins[role]
            return None
        return index


_NO_NAMES: Final[frozenset[str]] = frozenset()
_REFUSAL_ORDER: Final = {Fate.EXCLUDED: 0, Fate.FAILED: 1, Fate.PATIENCE: 2, Fate.ADMITTED: 3}


def _kept(made_at: float, until: float, unchanged: bool, now: float) -> bool:
    """Whether something derived at `made_at` still stands at `now`: before its `until`,
    and with its sources `unchanged`, or changed less than the ledger's coalescing window
    after it was made (the rankings and the frontier read the same way)."""
    return made_at <= now < until and (unchanged or now - made_at < BELIEF_COALESCE_SECONDS)


def _top_tier(fate: MachineFate) -> bool:
    return fate.placement is None or fate.placement[0] == 0


def _size_class_tokens(size: int) -> int:
    """The prompt size costs are compared at for prompts of `size` bits: three quarters
    of the way up its power of two (0 for an empty prompt)."""
    return 0 if size == 0 else (3 << size) // 4 if size > 1 else 1


def _alternatives(choice: Choice, fates: Sequence[MachineFate]) -> list[Alternative]:
    """The admitted machines with both a TTFT and a gap belief, in order."""
    found: list[Alternative] = []
    for fate in fates:
        belief = fate.belief
        if not fate.admitted or belief is None or belief.ttft is None or belief.gap is None:
            continue
        found.append(Alternative(choice.key(fate.machine), belief, fate.continues_partial))
    return found


def _contenders_of(alternatives: list[Alternative]) -> list[Alternative]:
    """`fastest.contenders` among all and among those that continue partial messages
    (what the watch compares once content reached the client), in their order."""
    keep = {id(a) for a in contenders(alternatives)}
    continuing = [a for a in alternatives if a.continues_partial]
    if continuing:
        keep.update(id(a) for a in contenders(continuing))
    return [a for a in alternatives if id(a) in keep]


def provider_of(candidate: Candidate) -> str:
    return candidate.provider.name


def _names(avoid: Collection[MachineKey] | Collection[str], provider: str, model: str) -> set[str]:
    names: set[str] = set()
    for item in avoid:
        if isinstance(item, MachineKey):
            if item.provider == provider and item.model == model:
                names.add(item.machine)
        else:
            names.add(item)
    return names


def _beyond_patience(
    belief: MachineBelief | None, expected: float | None, tokens: int, patience: float
) -> str | None:
    if belief is None:
        return None
    if expected is not None:
        if expected > patience:
            ttft, rate = belief.expected_ttft, belief.expected_rate
            assert ttft is not None
            assert rate is not None
            return (
                f"expected {expected:.1f} s (TTFT {ttft:.1f} s + {tokens} tokens at "
                f"{rate:.1f} tok/s) exceeds the role's patience of {patience:g} s"
            )
        return None
    ttft = belief.expected_ttft
    if ttft is not None and ttft > patience:
        return f"expected TTFT alone ({ttft:.1f} s) exceeds the role's patience of {patience:g} s"
    return None
