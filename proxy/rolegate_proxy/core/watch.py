"""Watching one arm as it answers (SPEC B5, B6, B7): the mid-stream rate test.

A `Watch` follows one upstream attempt from the moment it is sent. It is told of every
content event (`observe(now, tokens)`) and of the passing of time (`observe(now)`), and it
answers with an `Act` when the request should move: `ttft` (the first token is late),
`rate` (the stream has fallen decisively behind what this request could have elsewhere)
or `deadline` (the role's patience ran out on a stream that was keeping up).

**The one predicate.** `reading(now)` decides, in one place, both which clock the
ceiling runs on and which reason an act carries, so they can never disagree:

* no first token yet: the `first_token` clock; the act is `ttft`;
* producing, and the rate test has decided "fallen behind": the `rate` clock (the ceiling
  is the moment it decided); the act is `rate`;
* producing and keeping up: the `patience` clock (the request's start plus the role's
  patience); the act is `deadline`.

**The rate test** is a Wald sequential probability ratio test on the serving stream's
per-token gaps. With R tokens still expected, the best admissible alternative A (least
expected TTFT + R x gap: its switching cost included) would finish the rest in M seconds,
so r_e = R / M is the break-even rate. With tolerance rho (default 2):

* H0, keeping up: the stream writes at r0 = max(r_S, r_e / rho), where r_S is the serving
  machine's believed rate: a machine writing as believed is never moved unless even its
  belief is rho times worse than what moving offers;
* H1, fallen behind: the stream writes at r1 = min(r0, r_e) / rho^2: rho^2 times slower
  than it should, and at least rho^2 times slower than moving would finish the rest.
  The indifference point (where the evidence drifts neither way) is ~r1 x rho: a stream
  is moved only when it writes at about a rho-th of the rate it was kept at or less.

Each content event of k tokens over dt seconds is an observation y = log(dt / k); under
either hypothesis y is normal (log-normal gaps, the mean of k of them moment-matched) with
the serving belief's predictive variance, floored and bounded: a wide belief makes each
token weak evidence, a narrow one strong, and no belief is so wide that a healthy stream
tests as behind (`WatchSettings.max_log_var`, where the bound is worked out). The
per-event log-likelihood ratio is clipped to [-clip, clip] (Huber's robust test: no single
gap, a pause or a burst, decides), and the sum is floored at B so that a long healthy
stretch does not bank credit that would hide a later collapse. A `rate` act needs the sum
at A and at least `min_gaps` gaps.

**Silence is evidence.** A stream that has gone quiet is judged on a timer, not at its next
token: a silence of d seconds is at least as slow as floor(d x r1) gaps at the behind rate
r1, each worth that gap's (clipped) step, so the test decides once the sum with them
reaches A (they count toward `min_gaps` too). A machine believed at 60 tok/s, with an
alternative as fast, is decided about half a second into a silence. The silence is not
banked: a token that then arrives is tested as the one long gap it was.
A = log((1 - beta) / alpha), B = log(beta / (1 - alpha)); with alpha = 0.01 (false move)
and beta = 0.05 (missed move), A = 4.55 and B = -2.99. See docs/patience.md for the error
rates, measured and bounded.

**The late first token.** Before the first token, the arm is late once the wait exceeds
its own belief's exp(m + z sd) (z = 2: ~97th percentile) or once a first token could no
longer give a usable answer within the role's patience; a `ttft` act is then made if an
alternative is expected to finish sooner than waiting on (its TTFT + R x gap against this
arm's expected remaining wait + R x gap), and in any case once the patience is spent.

What an act leads to is B6's business (the caller): before content reached the client, a
race; after, a continuation on an alternative that continues partial messages; otherwise
the slow stream is kept and the ledger learns. `Act.movable` says whether the named
alternative can take over. Each reason acts at most once per watch.

Pure: the clock is an argument, nothing sleeps, nothing is sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from rolegate_policy.config import (
    CompiledRole,
)

from .beliefs import MIN_SECONDS, GapStats, MachineBelief, MachineKey
from .choice import Alternative
from .fastest import undominated


class ActReason(StrEnum):
    RATE = "rate"
    TTFT = "ttft"
    DEADLINE = "deadline"


class Clock(StrEnum):
    # Waiting for the first token: the ceiling is when it becomes late.
    FIRST_TOKEN = "first_token"
    # Producing, but fallen decisively behind: the ceiling is the moment that was decided.
    RATE = "rate"
    # Producing and keeping up: the ceiling is the request's start plus the role's patience.
    PATIENCE = "patience"


@dataclass(frozen=True, slots=True)
class WatchSettings:
    # alpha: the probability the test moves a stream that is keeping up (one test).
    false_move: float = 0.01
    # beta: the probability it keeps a stream that has fallen behind (one test).
    missed_move: float = 0.05
    # rho: how much sooner moving must finish the rest before it is worth it (see above).
    tolerance: float = 2.0
    # No single content event is worth more than this many nats either way.
    clip: float = 1.0
    # Token gaps seen before a rate act may be made.
    min_gaps: int = 8
    # A first token is late past exp(m + late_z * sd) of the machine's TTFT belief.
    late_z: float = 2.0
    # Floor on the per-token log-gap sd the test assumes (network jitter is never less).
    min_log_sd: float = 0.2
    # The per-token log-gap sd assumed for a serving machine with no gap belief.
    default_log_sd: float = 0.5
    # The rest of an answer is never assumed shorter than this share of the expected.
    tail_share: float = 0.25
    # How often a waiting arm wants to be looked at when nothing arrives.
    tick_seconds: float = 0.25

    def __post_init__(self) -> None:
        if not (0 < self.false_move < 1 and 0 < self.missed_move < 1):
            raise ValueError("error rates must be in (0, 1)")
        if self.false_move + self.missed_move >= 1:
            raise ValueError("false_move + missed_move must be below 1")
        if self.tolerance <= 1:
            raise ValueError("tolerance must be above 1")
        if self.clip <= 0 or self.min_log_sd <= 0 or self.default_log_sd <= 0:
            raise ValueError("clip and spreads must be positive")

    @property
    def upper(self) -> float:
        """Wald's A = log((1 - beta) / alpha): the sum at which the stream has fallen behind."""
        return math.log((1.0 - self.missed_move) / self.false_move)

    @property
    def lower(self) -> float:
        """Wald's B = log(beta / (1 - alpha)): the floor the sum is held at."""
        return math.log(self.missed_move / (1.0 - self.false_move))

    @property
    def max_log_var(self) -> float:
        """The widest per-token log-gap variance the test assumes: log(rho) / 2.

        Why a bound, and why this one. Both hypotheses are log-normal with the test's
        variance v (v_k <= v for an event of k tokens) and are matched on the *mean* gap:
        mu0 = -log r0 - v_k / 2 and mu1 = -log r1 - v_k / 2 = mu0 + d, where
        d = log(r0 / r1) >= 2 log(rho) (r1 <= r0 / rho^2 by construction). The step is
        linear in the observed log gap y:

            step(y) = ((y - mu0)^2 - (y - mu1)^2) / (2 v_k) = d (y - mu0 - d / 2) / v_k.

        A healthy stream writes at its machine's believed rate r_S: its gaps are
        log-normal with mean gap 1 / r_S, so E[y] = -log r_S - s^2 / 2 <= -log r_S for
        whatever spread s it really has. When the alternative is no faster than the
        serving machine, the break-even rate r_e is below r_S (it pays a first token
        too), so r0 = max(r_S, r_e / rho) = r_S and

            E[step] <= d (-log r_S + log r_S + v_k / 2 - d / 2) / v_k = d (v_k - d) / (2 v_k).

        Unbounded, that is positive as soon as v_k > d: with rho = 2, past a log-variance
        of 1.39 a stream at exactly its believed rate drifts toward "behind" (issue 31: a
        belief polluted to 6.49 moved a healthy 61 tok/s stream after 11-13 tokens). With
        v_k <= v <= log(rho) / 2 <= d / 4, v_k - d <= -3 d / 4, so

            E[step] <= -3 d^2 / (8 v_k) <= -3 d / 2 <= -3 log(rho) per event:

        the ratio drifts toward the serving machine by at least 2 nats an event at rho = 2,
        and, held at the floor B, a walk with that drift reaches A = B + 7.5 nats only as a
        large deviation. The clip keeps the sign: y is normal, so the step is symmetric
        about its mean, and an odd monotone clip of it has a mean of the same sign.

        The margin is what the bound buys beyond the worst case: the drift stays negative
        while E[y] < -log r_S + (d - v_k) / 2, i.e. for a stream up to rho^(3/4) (1.68x at
        rho = 2) slower than its believed mean gap, about 2.6 sd of the stream-to-stream
        spread of rates seen in seed 003. (log(rho) would have left sqrt(rho), 1.41x: with
        that spread, 23 of 1,000 jittered streams on the issue's belief were moved, against
        2 here, both beyond the margin; unbounded, all 1,000.)"""
        return math.log(self.tolerance) / 2.0


@dataclass(frozen=True, slots=True)
class Reading:
    """The one predicate's answer at a moment: whether the arm is keeping up, the clock
    its ceiling runs on, the reason an act at that ceiling carries, the ceiling itself,
    and the alternative an act would name (None: none would do better)."""

    keeping_up: bool
    clock: Clock
    reason: ActReason
    ceiling: float | None
    alternative: Alternative | None
    movable: bool


@dataclass(frozen=True, slots=True)
class Act:
    """The request should move (or, with no alternative, the fact that it could not)."""

    reason: ActReason
    alternative: Alternative | None
    # The alternative can take over now: nothing has reached the client (a race), or it
    # continues partial messages. False: keep the stream (B6) and let the ledger learn.
    movable: bool
    at: float
    tokens: int
    waited: float
    llr: float
    detail: str


@dataclass(frozen=True, slots=True)
class _Decision:
    at: float
    alternative: Alternative
    movable: bool
    detail: str
    # The log likelihood ratio that decided: the gaps seen, and a silence's share.
    llr: float


# Not frozen: one is made for every token of a stream that has alternatives (the hot loop).
@dataclass(slots=True)
class _Hypotheses:
    alternative: Alternative
    movable: bool
    # Tokens still expected, and the two rates (tokens per second) weighed.
    rest: float
    keep_rate: float
    behind_rate: float


_NOTHING: Final = (None, False)


class Watch:
    """The watch on one arm. `sent_at` is when this arm was sent (its TTFT clock),
    `started_at` when the client's request began (the patience clock; default sent_at).
    `serving` and `belief` name the machine answering, when known (an aggregator names it
    in its first chunk: call `identify`). `frontier` is the request's admitted machines
    (`Plan.frontier()`); the serving machine is left out of it. `streams_to_client`: content
    reaches the client as it arrives (after the first token only alternatives that continue
    partial messages can take over). `delivered`: tokens earlier arms already delivered."""

    def __init__(
        self,
        role: CompiledRole,
        *,
        sent_at: float,
        started_at: float | None = None,
        serving: MachineKey | None = None,
        belief: MachineBelief | None = None,
        frontier: Sequence[Alternative] = (),
        streams_to_client: bool = True,
        delivered: int = 0,
        queued: float = 0.0,
        settings: WatchSettings | None = None,
    ) -> None:
        self.settings = settings = settings or WatchSettings()
        self.patience = role.patience_seconds
        self.expected_tokens = max(role.expected_output_tokens, 1)
        # Asked on every token: worked out once.
        self._upper, self._lower = settings.upper, settings.lower
        self._floor = max(1.0, math.ceil(self.expected_tokens * settings.tail_share))
        self.sent_at = sent_at
        # When its machine is expected to start on it at the latest: after the wait in its
        # queue (SPEC B8), which no first token could beat, so lateness is judged from
        # here. The wait is whole answers of the machines ahead, as uncertain as the
        # belief of one, so it is allowed the rate test's tolerance.
        self.starts_at = sent_at + settings.tolerance * max(queued, 0.0)
        self.started_at = sent_at if started_at is None else started_at
        self.serving = serving
        self.belief = belief
        self.frontier = tuple(frontier)
        self._others: tuple[Alternative, ...] = ()
        self._continuing: tuple[Alternative, ...] = ()
        self._believed_gap: float | None = None
        self._log_var = 0.0
        self._sort_frontier()
        self.streams_to_client = streams_to_client
        self.delivered = max(delivered, 0)
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.tokens = 0
        self.llr = 0.0
        # Seconds the client held this arm's stream (its relay says; every time this
        # watch is given leaves them out: they are not the machine's).
        self.client_held = 0.0
        self.acts: list[Act] = []
        self._gaps = GapStats()
        self._decision: _Decision | None = None
        self._acted: set[ActReason] = set()

    # -- what is known ----------------------------------------------------------------------

    def identify(self, serving: MachineKey, belief: MachineBelief | None) -> None:
        """The machine answering became known (an aggregator's chunk named it)."""
        self.serving = serving
        self.belief = belief
        self._sort_frontier()

    def _sort_frontier(self) -> None:
        # Only the alternatives that can be soonest for some length: `_best` runs on every
        # content event, and gives the same answer over these as over all of them.
        others = [a for a in self.frontier if a.key != self.serving]
        self._others = tuple(undominated(others))
        self._continuing = tuple(undominated(a for a in others if a.continues_partial))
        gap = None if self.belief is None else self.belief.gap
        self._believed_gap = None if gap is None else gap.mean()
        settings = self.settings
        var = settings.default_log_sd**2 if gap is None else gap.log_var
        # Floored (jitter is never less), then bounded (`max_log_var`: beyond it a healthy
        # stream would test as behind); the bound wins should the two ever cross.
        self._log_var = min(max(var, settings.min_log_sd**2), settings.max_log_var)

    @property
    def deadline(self) -> float:
        return self.started_at + self.patience

    @property
    def gaps(self) -> GapStats:
        return self._gaps

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at

    @property
    def keeping_up(self) -> bool:
        """The rate test's state: False once it has decided the stream fell behind."""
        return self._decision is None

    def remaining(self) -> float:
        """Tokens still expected: the role's expectation less what was delivered, never
        below `tail_share` of it."""
        seen = self.delivered + self.tokens
        return max(float(self.expected_tokens - seen), self._floor)

    # -- the one predicate ------------------------------------------------------------------

    def reading(self, now: float) -> Reading:
        """The one predicate: which clock the ceiling runs on and the reason an act at it
        carries, decided together (see the module's docstring)."""
        if self.first_at is None:
            ceiling, alternative, movable = self._first_token(now)
            return Reading(
                now < ceiling, Clock.FIRST_TOKEN, ActReason.TTFT, ceiling, alternative, movable
            )
        if self._decision is not None:
            decision = self._decision
            return Reading(
                False,
                Clock.RATE,
                ActReason.RATE,
                decision.at,
                decision.alternative,
                decision.movable,
            )
        alternative, movable = self._better_than_keeping(now)
        return Reading(
            True, Clock.PATIENCE, ActReason.DEADLINE, self.deadline, alternative, movable
        )

    def next_check(self, now: float) -> float | None:
        """When this watch next wants `observe(now)` if nothing arrives (None: never)."""
        reading = self.reading(now)
        if reading.reason in self._acted or reading.ceiling is None:
            return None
        if reading.clock is Clock.FIRST_TOKEN and reading.ceiling <= now:
            # Late, but nothing better yet: look again shortly, and at the deadline.
            return min(now + self.settings.tick_seconds, max(self.deadline, now))
        ceiling = max(reading.ceiling, now)
        if reading.clock is Clock.PATIENCE:
            decisive = self._silence_decisive_at()
            if decisive is not None:
                return max(min(ceiling, decisive), now)
        return ceiling

    # -- events -----------------------------------------------------------------------------

    def observe(self, now: float, tokens: int = 0) -> Act | None:
        """A content event carrying `tokens` tokens arrived at `now`, or (tokens=0) time
        passed. Returns the act now due, if any."""
        if tokens > 0:
            if self.first_at is None:
                self.first_at = self.last_at = now
            else:
                assert self.last_at is not None
                elapsed = max(now - self.last_at, 0.0)
                self._test(tokens, elapsed, now)
                self._gaps = self._gaps.add(tokens, elapsed)
                self.last_at = now
            self.tokens += tokens
        elif self.first_at is not None:
            self._test_silence(now)
        return self._due(now)

    # -- inside -----------------------------------------------------------------------------

    def _due(self, now: float) -> Act | None:
        if self.first_at is not None:
            # Producing: nothing is due before the deadline unless the test decided.
            decided = self._decision is not None
            if (not decided and now < self.deadline) or (decided and ActReason.RATE in self._acted):
                return None
        reading = self.reading(now)
        if reading.reason in self._acted or reading.ceiling is None:
            return None
        if reading.clock is Clock.FIRST_TOKEN:
            past_patience = now >= self.deadline
            late = now >= reading.ceiling and reading.alternative is not None
            if not (past_patience or late):
                return None
        elif now < reading.ceiling:
            return None
        act = Act(
            reading.reason,
            reading.alternative,
            reading.movable,
            now,
            self.tokens,
            now - self.sent_at,
            self.llr,
            self._detail(reading, now),
        )
        self._acted.add(reading.reason)
        self.acts.append(act)
        return act

    def _best(self, tokens: float) -> tuple[Alternative, bool] | None:
        """The admissible alternative finishing `tokens` soonest, and whether it can take
        over: before content, any (a race); after content reached the client, one that
        continues partial messages, else the best of all (which cannot: keep)."""
        pool, movable = self._others, True
        if self.first_at is not None and self.streams_to_client:
            pool, movable = (self._continuing, True) if self._continuing else (pool, False)
        if not pool:
            return None
        if len(pool) == 1:
            return pool[0], movable
        best = min(pool, key=lambda a: (a.expected_seconds(tokens), a.key))
        return best, movable

    def _serving_gap(self) -> float | None:
        return self._believed_gap

    def _first_token(self, now: float) -> tuple[float, Alternative | None, bool]:
        """The waiting arm's ceiling, and the alternative if moving now beats waiting."""
        settings = self.settings
        rest = self.remaining()
        best = self._best(rest)
        ttft_belief = None if self.belief is None else self.belief.ttft
        if best is None:
            return self.deadline, None, False
        alternative, movable = best
        gap = self._serving_gap()
        gap = alternative.expected_gap if gap is None else gap
        if ttft_belief is not None:
            late_at = self.starts_at + ttft_belief.upper(settings.late_z)
        else:
            late_at = self.starts_at + settings.tolerance * alternative.expected_ttft
        ceiling = min(late_at, self.deadline - rest * gap)
        waited = max(now - self.starts_at, 0.0)
        if ttft_belief is None:
            residual = waited
        else:
            residual = ttft_belief.residual(waited)
            if now >= late_at:
                # Past the late point the belief no longer describes this arm (a queue, a
                # stuck machine). On a narrow belief its residual stays tiny however long
                # the wait, promising the token any moment: the narrower the belief, the
                # longer an arm would wait. Expect at least as long again as it is overdue.
                residual = max(residual, waited - ttft_belief.mean())
        keep = residual + rest * gap
        move = alternative.expected_seconds(rest)
        if move < keep:
            return ceiling, alternative, movable
        return ceiling, None, False

    def _better_than_keeping(self, now: float) -> tuple[Alternative | None, bool]:
        rest = self.remaining()
        best = self._best(rest)
        if best is None:
            return _NOTHING
        gap = self._observed_gap() or self._serving_gap()
        if gap is None:
            return _NOTHING
        alternative, movable = best
        if alternative.expected_seconds(rest) < rest * gap:
            return alternative, movable
        return _NOTHING

    def _observed_gap(self) -> float | None:
        if self._gaps.count < self.settings.min_gaps:
            return None
        mean, var = self._gaps.mean_log, self._gaps.var_log
        assert mean is not None
        assert var is not None
        return math.exp(mean + var / 2.0)

    def _hypotheses(self) -> _Hypotheses | None:
        """The two rates the test weighs, against the best alternative now (None: there is
        no alternative, so nothing to decide)."""
        if not self._others:
            return None  # nowhere to move: nothing to decide (what `_best` would find)
        settings = self.settings
        rest = self.remaining()
        best = self._best(rest)
        if best is None:
            return None
        alternative, movable = best
        even = rest / alternative.expected_seconds(rest)
        believed = self._serving_gap()
        keep_rate = even / settings.tolerance
        if believed is not None:
            keep_rate = max(keep_rate, 1.0 / believed)
        behind_rate = min(keep_rate, even) / settings.tolerance**2
        return _Hypotheses(alternative, movable, rest, keep_rate, behind_rate)

    def _step(self, hypotheses: _Hypotheses, tokens: int, gap: float) -> float:
        """The clipped log-likelihood ratio of `tokens` tokens arriving `gap` seconds apart
        each: behind against keeping up."""
        var = self._log_var
        # The log of the mean of k log-normal gaps: variance shrinks with k, moment-matched.
        var_k = math.log1p(math.expm1(var) / tokens)
        mu0 = -math.log(hypotheses.keep_rate) - var_k / 2.0
        mu1 = -math.log(hypotheses.behind_rate) - var_k / 2.0
        y = math.log(max(gap, MIN_SECONDS))
        step = ((y - mu0) ** 2 - (y - mu1) ** 2) / (2.0 * var_k)
        return min(max(step, -self.settings.clip), self.settings.clip)

    def _test(self, tokens: int, elapsed: float, now: float) -> None:
        """One SPRT step for an event of `tokens` tokens `elapsed` seconds after the last."""
        if self._decision is not None:
            return
        hypotheses = self._hypotheses()
        if hypotheses is None:
            return
        settings = self.settings
        step = self._step(hypotheses, tokens, elapsed / tokens)
        self.llr = max(self.llr + step, self._lower)
        gaps = self._gaps.count + tokens
        if self.llr >= self._upper and gaps >= settings.min_gaps:
            observed = gaps / max(now - (self.first_at or now), MIN_SECONDS)
            self._decide(now, hypotheses, f"{int(gaps)} gaps at {observed:.1f} tok/s")

    def _silence(self) -> tuple[_Hypotheses, float] | None:
        """What a silence is tested against, and what one behind-rate gap of it is worth."""
        if self._decision is not None or self.last_at is None:
            return None
        hypotheses = self._hypotheses()
        if hypotheses is None:
            return None
        worth = self._step(hypotheses, 1, 1.0 / hypotheses.behind_rate)
        return (hypotheses, worth) if worth > 0 else None

    def _silence_gaps_needed(self, worth: float) -> int:
        """Behind-rate gaps of silence that would decide, on top of what was seen."""
        by_evidence = math.ceil(max(self._upper - self.llr, 0.0) / worth)
        by_count = math.ceil(max(self.settings.min_gaps - self._gaps.count, 0.0))
        return max(by_evidence, by_count, 1)

    def _silence_decisive_at(self) -> float | None:
        """When the silence since the last token, if it lasts, decides the test."""
        found = self._silence()
        if found is None:
            return None
        hypotheses, worth = found
        assert self.last_at is not None
        return self.last_at + self._silence_gaps_needed(worth) / hypotheses.behind_rate

    def _test_silence(self, now: float) -> None:
        """Decide on the silence since the last token, without banking it."""
        found = self._silence()
        if found is None:
            return
        hypotheses, worth = found
        assert self.last_at is not None
        silent = now - self.last_at
        gaps = math.floor(silent * hypotheses.behind_rate)
        if gaps >= self._silence_gaps_needed(worth):
            # (The silence's share counted in the ratio that decided, not banked.)
            self._decide(now, hypotheses, f"silent for {silent:.2f} s", self.llr + gaps * worth)

    def _decide(
        self, now: float, hypotheses: _Hypotheses, seen: str, llr: float | None = None
    ) -> None:
        alternative, rest = hypotheses.alternative, hypotheses.rest
        self._decision = _Decision(
            now,
            alternative,
            hypotheses.movable,
            f"{seen}; kept at {hypotheses.keep_rate:.1f} tok/s, behind at "
            f"{hypotheses.behind_rate:.1f}; {alternative.key.describe()} would finish "
            f"{rest:.0f} tokens in {alternative.expected_seconds(rest):.1f} s",
            self.llr if llr is None else llr,
        )

    def _detail(self, reading: Reading, now: float) -> str:
        waited = now - self.sent_at
        where = (
            f"; move to {reading.alternative.key.describe()}"
            + ("" if reading.movable else " (cannot take over: keep)")
            if reading.alternative is not None
            else "; nothing better to move to"
        )
        if reading.reason is ActReason.RATE:
            assert self._decision is not None
            return (
                f"rate: log LR {self._decision.llr:.2f} >= {self.settings.upper:.2f} after "
                f"{self._decision.detail}{where}"
            )
        if reading.reason is ActReason.TTFT:
            return f"ttft: no first token after {waited:.2f} s{where}"
        return f"deadline: patience of {self.patience:g} s spent at {self.tokens} tokens{where}"
