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
* **Ranking (C4, C5, B8).** The admitted machines are ranked by `ranking.rank`: quality
  first (the shrunk operational score, in dithered tiers of the role's quality tolerance),
  then the semantic score as a demotion only, then speed (a machine far slower than the
  fastest of equal quality goes after it), then expected cost, then expected time (an
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
* **Load (B8).** A busy machine's expected time includes its queue (`core/load.py`):
  each decision reorders the kept ranking by the queues as they are now (`_queued`).
* **Affinity (B3).** The machine that last answered for the role leads its candidate's
  order unless it is refused now, and a refused machine loses the pin. So does one that
  fell out of the top quality tier (the score lowers preference, the pin must not
  outlive that) or is far slower than a machine of equal quality (affinity is a
  tie-break, never a reason to stay slow).
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
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final

from rolegate_policy.config import (
    CompiledMachine,
    CompiledModel,
    CompiledRole,
)

from .affinity import Affinity, still_leads
from .beliefs import (
    BELIEF_COALESCE_SECONDS,
    BELIEF_REFRESH_SECONDS,
    Ledger,
    MachineBelief,
    MachineKey,
)
from .choice import (
    AFFINITY,
    Alternative,
    Choice,
    Fate,
    MachineFate,
    Plan,
    Ranked,
    by_expected_time,
    contenders_of,
)
from .exclusions import (
    Exclusion,
)
from .field import least_observed, queued_order, score_field, with_queue
from .load import Load
from .ranking import Placed, rank
from .routing import Candidate
from .score import Scoreboard

# (provider, model, machine or None for a direct provider, now) -> why it may not be sent
# to. `Breakers.exclusion` is one: a read that changes nothing.
ExclusionLookup = Callable[[str, str, str | None, float], Exclusion | None]

PATIENCE: Final = "patience"
FAILED: Final = "failed"
# Roles whose frontier, and compiled models whose machines, are kept at most.
MAX_KEPT: Final = 1024
# Standings kept at most (role x candidate x prompt-size class; see `Chooser._standing`).
MAX_STANDINGS: Final = 4096
# Machines of a model known only from sightings (an aggregator named them) that routing
# considers, and so names in the routing field: the most recently sighted ones.
MAX_LEARNED_MACHINES: Final = 64


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
    each role's affinity pin (`affinity`). Pure; `now` is passed in. Not thread-safe."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        scores: Scoreboard | None = None,
        draw: Callable[[], float] | None = None,
        explore: float = 0.0,
        exclusions_epoch: Callable[[], int] | None = None,
        load: Load | None = None,
    ) -> None:
        if not 0.0 <= explore < 1.0:
            raise ValueError(f"the exploration share must be in [0, 1), got {explore}")
        self.ledger = ledger
        # Requests in flight per machine (SPEC B8): each decision lengthens a busy
        # machine's expected time by its queue (`_queued`). None: load is not counted.
        self.load = load
        # The share of decisions in which a machine other than the best leads, for a role
        # that declares no `explorationShare` of its own (see `_exploring`); 0 in the pure
        # tests, ProxySettings.explore_share in the proxy.
        self.explore = explore
        self.scores = scores if scores is not None else Scoreboard()
        # Uniform on [0, 1): the dither of the quality tiers. Tests pass a seeded one.
        self.draw = draw if draw is not None else random.Random().random
        # Each role's pin (SPEC B3).
        self.affinity = Affinity()
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
            pin = self.affinity.pinned(role.name)
            choices.append(
                self.choose(
                    role, candidate, exclusion, now, avoid=avoid, prompt_tokens=prompt_tokens
                )
            )
            if pin is not None and self.affinity.pinned(role.name) is None:
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
        frontier = tuple(contenders_of(list(plan.frontier())))
        if epoch is not None:
            until = min(
                (c.ranked.until for c in plan.choices if c.ranked is not None),
                default=now + BELIEF_REFRESH_SECONDS,
            )
            if len(self._frontiers) >= MAX_KEPT:
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
        return self._finish(role, candidate, ranked, now)

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

    def _finish(
        self, role: CompiledRole, candidate: Candidate, ranked: Ranked, now: float
    ) -> Choice:
        """The choice this request makes of a ranking: reordered by the machines' queues
        as they are now, the affinity pin leads (or is dropped), and in an exploring
        decision the least observed machine leads. The ranking itself is left as it was
        (the fates this touches are copies)."""
        admitted = ranked.admitted
        queued = self._queued(role, candidate, admitted, now)
        pinned = self.affinity.position(role.name, ranked)
        if queued is not None:
            admitted = queued
            pinned = still_leads(ranked, pinned, queued)
        explore = self._exploring(role, len(admitted))
        if pinned is None and not explore:
            return ranked.choice if queued is None else ranked.finished(queued, None)
        order = list(admitted)
        pinned_name = None
        if pinned is not None:
            fate = copy.copy(order.pop(pinned))
            fate.reason = AFFINITY
            order.insert(0, fate)
            pinned_name = fate.machine
        at = least_observed(self.scores, order, _slow) if explore else None
        if at is not None:
            explored = copy.copy(order.pop(at))
            explored.explored = True
            order.insert(0, explored)
            pinned_name = None
        return ranked.finished(order, pinned_name)

    def _queued(
        self,
        role: CompiledRole,
        candidate: Candidate,
        admitted: Sequence[MachineFate],
        now: float,
    ) -> list[MachineFate] | None:
        """`field.queued_order` when any machine of the candidate may be busy (None: no
        machine waits, or there is nothing to order)."""
        load = self.load
        provider, model = candidate.provider.name, candidate.model.name
        if load is None or len(admitted) < 2 or not load.busy(provider, model, now):
            return None
        sheet, _, _ = self._sheet(candidate)
        return queued_order(load, role, sheet, admitted, now)

    def _rank(
        self,
        role: CompiledRole,
        admitted: list[MachineFate],
        sheet: dict[str, CompiledMachine],
        prompt_tokens: int,
    ) -> tuple[list[MachineFate], float]:
        """Two or more admitted machines in rank order, each with its placement (one alone
        is not ranked, and takes no draw), and the target their scores were shrunk to."""
        target = score_field(self.scores, role, admitted, sheet, prompt_tokens)
        ranked = []
        for place in rank(admitted, role.quality_tolerance, self.draw, role.speed_tolerance):
            fate = place.entry
            fate.placement = (place.tier, place.behind, place.semantic_demoted, place.slow)
            ranked.append(fate)
        return ranked, target

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
        if len(self._sheets) >= MAX_KEPT:
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
                pinned = self.affinity.position(role.name, ranked)
                head = ranked.head(ranked.admitted[0 if pinned is None else pinned])
                sheet, _, _ = self._sheet(candidate)
                if head.cost is None and head.view is None:
                    score_field(self.scores, role, [head], sheet, ranked.prompt_tokens)  # its cost
                if self.load is not None and self.load.busy(
                    candidate.provider.name, candidate.model.name, now
                ):
                    head = with_queue(self.load, head, sheet, now)
                entries.append(head)
                by_key[head.key] = candidate
            # The heads are ranked against each other: shrunk towards their own field.
            score_field(self.scores, role, entries, None, prompt_tokens)
            placed = rank(entries, role.quality_tolerance, self.draw, role.speed_tolerance)
            heads = [place.entry for place in placed]
            if self._exploring(role, len(heads)):
                at = least_observed(self.scores, heads, _marked_slow(placed))
                if at is not None:
                    heads.insert(0, heads.pop(at))
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


_NO_NAMES: Final[frozenset[str]] = frozenset()
_REFUSAL_ORDER: Final = {Fate.EXCLUDED: 0, Fate.FAILED: 1, Fate.PATIENCE: 2, Fate.ADMITTED: 3}


def _marked_slow(placed: Sequence[Placed[MachineFate]]) -> Callable[[MachineFate], bool]:
    """Whether a head was marked slow when the heads were ranked against each other."""
    slow = frozenset(place.entry.key for place in placed if place.slow)
    return lambda fate: fate.key in slow


def _slow(fate: MachineFate) -> bool:
    placement = fate.placement
    return placement is not None and placement[3]


def _kept(made_at: float, until: float, unchanged: bool, now: float) -> bool:
    """Whether something derived at `made_at` still stands at `now`: before its `until`,
    and with its sources `unchanged`, or changed less than the ledger's coalescing window
    after it was made (the rankings and the frontier read the same way)."""
    return made_at <= now < until and (unchanged or now - made_at < BELIEF_COALESCE_SECONDS)


def _size_class_tokens(size: int) -> int:
    """The prompt size costs are compared at for prompts of `size` bits: three quarters
    of the way up its power of two (0 for an empty prompt)."""
    return 0 if size == 0 else (3 << size) // 4 if size > 1 else 1


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
