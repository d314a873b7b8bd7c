"""What the proxy believes about each machine (SPEC B1, B2, B7): the ledger.

A belief is held per (provider, model, machine) for two durations: the time to first token
(TTFT) and the per-token gap. Each is log-normal with unknown location and spread, and the
belief about those is Normal-Inverse-Gamma on the log scale (the conjugate prior), so every
belief gives a posterior predictive (a Student-t on the log scale): a likelihood for an
observed value and an honest spread, wider when little has been seen.

* **The sheet prior.** A ProviderPolicy's published `ttftSeconds` and `tokensPerSecond`
  seed a prior worth `sheet_weight` pseudo-observations, mean-matched (the published figure
  is the prior's expected value; a rate becomes a gap of 1/rate). The prior never decays.
* **Sightings.** Every arm files one `Sighting` (the winner, a race's loser, an arm that
  errored, was cut or was abandoned): its TTFT, or the censored wait of an arm that never
  saw a first token, and the sufficient statistics of its gaps (count, sum and sum of
  squares of log gaps). Nothing per token is stored.
* **Forgetting.** The data's pseudo-counts decay with a half-life and are capped, so a
  night of fast answers does not outvote a fresh collapse, and after a long silence the
  belief drifts back to the sheet. One stream's gaps count for at most `stream_weight`
  pseudo-observations (its tokens are one stream's weather, not independent draws).
* **Censored TTFT.** "No first token after T seconds" is evidence that TTFT >= T. When T
  is beyond the belief's median it is filed as the belief's own expectation of log TTFT
  given that it exceeded T (one EM-style imputation under the current predictive); below
  the median it is nearly uninformative and is not filed. Either way a late first token
  only ever moves the belief towards lateness.
* **Unknown machines.** A machine with no published figure and no sighting has no belief
  (None). Its first sighting gives it a weak prior (`learned_weight`) centred on what was
  seen, and from then on it is a candidate, and refusable, like any other (SPEC B2).
* **Whole answers (SPEC B7).** A non-streamed answer of k tokens shows one number, its total
  time T, and never per-token gaps: a cached or batched answer in 2 ms is no evidence that
  the machine's streams write a token every 22 us. It is filed as the answer's *pace*, T
  over what the machine's published shape (its TTFT + k x its gap, a reference shape where
  nothing is published) gives for k tokens, in a third belief of its own (`completion`).
  The gap and TTFT beliefs, and with them the rate test, never see it. The expected time
  to a usable answer (`MachineBelief.expected_seconds`) is a joint estimate: the streams'
  TTFT + k x gap and the answers' pace x shape, averaged on the log scale by the evidence
  behind each, so a machine that answers non-streamed requests 100x slower than published
  is believed slow, and one that answers them instantly moves routing but not the gaps.
  A machine known only from whole answers takes stand-in priors (weight `learned_weight`)
  for its TTFT and gap from its pace, until a stream teaches them.
* **Bounded spread.** A gap or pace belief's predictive log-variance is held at
  `max_log_var` (a per-token log-sd of 1: the 97th percentile within 7x of the median),
  its mean kept: a wider one says that what was mixed is not one machine's (issue 31 saw
  6.49 from 2 ms answers filed with 15 ms gaps), and a likelihood that wide finds nothing
  surprising. The rate test bounds the variance it assumes further (core/watch.py).

* **Bounded (SPEC E8).** Every duration filed is held within core/plausible.py's ranges (a
  TTFT of 1 ms to 1 h, a gap of 0.1 ms to 1 h), so what a pod shares its peers accept;
  every exponential a belief answers is held within 1e-9 s to 1e9 s, so no value that
  reaches it, heard or restored, can overflow a routing decision; and one peer's evidence
  weighs at most `max_weight` observations, whatever count it claims.

Pure: no I/O, no event loop; the clock is an argument. Memory is bounded (`max_keys`).
See docs/patience.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, KeysView
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, NamedTuple

from rolegate_policy.config import (
    CompiledMachine,
    ProxyConfig,
)

from .plausible import (
    GAP_LOG,
    MAX_BELIEVED_SECONDS,
    MAX_EVIDENCE_WEIGHT,
    MIN_BELIEVED_SECONDS,
    MIN_GAP_SECONDS,
    MIN_TTFT_SECONDS,
    PACE_LOG,
    TTFT_LOG,
)
from .versions import Versions

# Any duration is floored here before its log is taken (a burst of tokens in one network
# read has a gap of "zero"). Observations are further held within core/plausible.py's
# ranges when filed, so what a pod shares is always what its peers accept.
MIN_SECONDS: Final = MIN_GAP_SECONDS
# A published TTFT of 0 ("instant") is read as this.
MIN_PUBLISHED_TTFT: Final = MIN_TTFT_SECONDS
_LOG_BELIEVED_LOW: Final = math.log(MIN_BELIEVED_SECONDS)
_LOG_BELIEVED_HIGH: Final = math.log(MAX_BELIEVED_SECONDS)
# A non-streamed answer's time is read against the machine's published shape; where none
# is published, against this reference one: a second to the first token, then 50 tokens a
# second. (Any fixed shape would do: what matters is that it never moves, so paces filed
# an hour apart are of the same thing.)
REFERENCE_TTFT: Final = 1.0
REFERENCE_GAP: Final = 0.02
_SQRT2: Final = math.sqrt(2.0)
_LOG_SQRT_2PI: Final = 0.5 * math.log(2.0 * math.pi)


class Source(StrEnum):
    """Where a belief's prior came from."""

    # A ProviderPolicy published figures for this machine.
    SHEET = "sheet"
    # Known only from sightings (an aggregator routed to it without our asking).
    LEARNED = "learned"


class MachineKey(NamedTuple):
    """One machine serving one model behind one provider. For a direct (OpenAI-dialect)
    provider the machine is the model's single machine name. A named tuple: built and
    hashed for every machine of every routing decision, so it must be cheap."""

    provider: str
    model: str
    machine: str

    def describe(self) -> str:
        return f"{self.machine} serving {self.model} at {self.provider}"


# --- what one arm saw -------------------------------------------------------------------------


# Not frozen: one is made for every content chunk of a stream (and every non-streamed
# answer), and a frozen dataclass sets each field through object.__setattr__, three times
# slower. Nothing changes one once made (`add` makes another): hashed as if frozen.
@dataclass(slots=True, unsafe_hash=True)
class GapStats:
    """Sufficient statistics of a stream's per-token gaps on the log scale: how many, the
    sum of log gaps and the sum of their squares (seconds)."""

    count: float = 0.0
    sum_log: float = 0.0
    sum_sq: float = 0.0

    def add(self, tokens: int, seconds: float) -> GapStats:
        """`tokens` tokens that arrived `seconds` after the previous content: each is
        counted as a gap of seconds / tokens."""
        if tokens <= 0:
            return self
        y = GAP_LOG.clamp(math.log(max(seconds / tokens, MIN_SECONDS)))
        return GapStats(
            self.count + tokens, self.sum_log + tokens * y, self.sum_sq + tokens * y * y
        )

    @classmethod
    def of(cls, gaps: Iterable[float]) -> GapStats:
        stats = cls()
        for gap in gaps:
            stats = stats.add(1, gap)
        return stats

    @property
    def mean_log(self) -> float | None:
        return self.sum_log / self.count if self.count > 0 else None

    @property
    def var_log(self) -> float | None:
        """The population variance of the log gaps (0 for a single gap)."""
        if self.count <= 0:
            return None
        mean = self.sum_log / self.count
        return max(self.sum_sq / self.count - mean * mean, 0.0)

    @property
    def median_rate(self) -> float | None:
        """Tokens per second at the median gap (exp of the mean log gap)."""
        mean = self.mean_log
        return None if mean is None else 1.0 / duration(mean)


# No gaps at all: immutable, so one instance serves every arm that saw none.
NO_GAPS: Final = GapStats()


class Completed(NamedTuple):
    """A whole non-streamed answer: `tokens` output tokens, all of them `seconds` after the
    request was sent. Its first token's time and its gaps are not in it."""

    seconds: float
    tokens: int


class Shape(NamedTuple):
    """What a machine's published figures give for an answer of `tokens` tokens: a first
    token after `ttft` seconds, then one every `gap`."""

    ttft: float
    gap: float

    def seconds(self, tokens: float) -> float:
        return self.ttft + max(tokens, 0.0) * self.gap


REFERENCE_SHAPE: Final = Shape(REFERENCE_TTFT, REFERENCE_GAP)


# Not frozen, as MachineBelief below: one is made for every arm, on the request path, and a
# frozen dataclass sets each field through object.__setattr__. Nothing changes one once made.
@dataclass(slots=True)
class Sighting:
    """What one arm taught about its machine. `ttft` is the exact time to first token when
    one arrived; `waited` is how long an arm that never saw a first token was waited on
    before it was cut or abandoned (evidence that TTFT >= waited; never set for an arm that
    failed with an error, which says nothing about when a token would have come). `gaps` are
    the per-token gaps after the first token. `completed` is a whole non-streamed answer
    (its time for its tokens, nothing finer). `cut` marks an arm that ended before its
    answer did (moved, lost a race, errored, abandoned): it teaches all the same. `at` is
    when it was filed, on the ledger's clock."""

    provider: str
    model: str
    machine: str
    at: float
    ttft: float | None = None
    waited: float | None = None
    gaps: GapStats = NO_GAPS
    cut: bool = False
    completed: Completed | None = None

    def __post_init__(self) -> None:
        if self.ttft is not None and self.waited is not None:
            raise ValueError("a sighting has an exact TTFT or a censored wait, not both")

    @property
    def key(self) -> MachineKey:
        return MachineKey(self.provider, self.model, self.machine)

    @property
    def teaches(self) -> bool:
        return (
            self.ttft is not None
            or bool(self.waited)
            or self.gaps.count > 0
            or self.completed is not None
        )


# --- the distributions ------------------------------------------------------------------------


def duration(log_seconds: float) -> float:
    """exp of a log duration, held within what a belief may answer (core/plausible.py):
    never an OverflowError, never 0 (a rate is its inverse), and a NaN reads as the longest
    (a belief nobody can read refuses its machine rather than promising it instant)."""
    if not log_seconds < _LOG_BELIEVED_HIGH:
        return MAX_BELIEVED_SECONDS
    if log_seconds < _LOG_BELIEVED_LOW:
        return MIN_BELIEVED_SECONDS
    return math.exp(log_seconds)


def upper_tail(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / _SQRT2)


def _normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z - _LOG_SQRT_2PI)


def truncated_mean(mean: float, sd: float, floor: float) -> float:
    """E[Y | Y >= floor] for Y ~ Normal(mean, sd^2); always >= max(floor, mean)."""
    if sd <= 0:
        return max(mean, floor)
    alpha = (floor - mean) / sd
    tail = upper_tail(alpha)
    if tail < 1e-300:  # far in the tail: the inverse Mills ratio is ~alpha
        return floor + sd / max(alpha, 1e-12)
    return max(mean + sd * _normal_pdf(alpha) / tail, floor)


class LogNormal(NamedTuple):
    """A belief about a positive duration X: log X ~ Normal(mu, sigma^2) with (mu, sigma^2)
    ~ Normal-Inverse-Gamma(m, kappa, a, b). `weight` is the data's pseudo-count behind it
    (after forgetting, without the prior's)."""

    m: float
    kappa: float
    a: float
    b: float
    weight: float = 0.0

    @property
    def sigma2(self) -> float:
        """The posterior mean of sigma^2 (a > 1 always holds here)."""
        return self.b / (self.a - 1.0)

    @property
    def dof(self) -> float:
        """Degrees of freedom of the predictive Student-t on log X."""
        return 2.0 * self.a

    @property
    def scale(self) -> float:
        """Scale of the predictive Student-t on log X."""
        return math.sqrt(self.b * (self.kappa + 1.0) / (self.a * self.kappa))

    @property
    def log_var(self) -> float:
        """Variance of the predictive on log X: sigma2 * (1 + 1/kappa). Wide when little
        has been seen (small kappa) or what was seen was scattered (large b)."""
        return self.sigma2 * (1.0 + 1.0 / self.kappa)

    @property
    def log_sd(self) -> float:
        return math.sqrt(self.log_var)

    def median(self) -> float:
        return duration(self.m)

    def bounded(self, max_log_var: float) -> LogNormal:
        """This belief with its predictive log-variance held at `max_log_var` and its mean
        kept (the location moves up by half the variance taken off; the counts are kept).
        The mean is what routing reads and what the rate test keeps a stream to: lowering
        it with the spread would have a healthy stream of a scattered machine (or of one
        whose old evidence is polluted) write slower than believed, and test as behind."""
        excess = self.log_var - max_log_var
        if not excess > 0:
            return self
        b = max_log_var * (self.a - 1.0) * self.kappa / (self.kappa + 1.0)
        return self._replace(m=self.m + excess / 2.0, b=b)

    def mean(self) -> float:
        """The expected value of X: a log-normal's mean at the predictive's location and
        variance, so uncertainty raises it (an unsure belief promises less)."""
        # log_var, written out: this is asked on every routing decision.
        return duration(self.m + 0.5 * self.b / (self.a - 1.0) * (1.0 + 1.0 / self.kappa))

    def upper(self, z: float) -> float:
        """exp(m + z * sd): e.g. z = 2 is roughly the predictive's 97th percentile."""
        return duration(self.m + z * self.log_sd)

    def log_pdf(self, x: float) -> float:
        """Log density of the predictive at x (seconds): Student-t on log x, with the
        Jacobian, so it is a density of x itself."""
        y = math.log(max(x, MIN_SECONDS))
        nu, s = self.dof, self.scale
        u = (y - self.m) / s
        return (
            math.lgamma((nu + 1.0) / 2.0)
            - math.lgamma(nu / 2.0)
            - 0.5 * math.log(nu * math.pi)
            - math.log(s)
            - (nu + 1.0) / 2.0 * math.log1p(u * u / nu)
            - y
        )

    def residual(self, waited: float) -> float:
        """E[X - waited | X > waited]: how much longer, on this belief, something that has
        not happened after `waited` seconds is still expected to take."""
        if waited <= 0:
            return self.mean()
        sd = self.log_sd
        z = (math.log(waited) - self.m) / sd
        tail = upper_tail(z)
        if tail < 1e-300:
            # Far in the tail the hazard is ~z / (sd * waited): mean residual ~ its inverse.
            return waited * sd / max(z, 1e-12)
        conditional = self.mean() * upper_tail(z - sd) / tail
        return max(conditional - waited, 0.0)


@dataclass(slots=True)
class MachineBelief:
    """What is believed about one machine now. Either part may be missing (a sheet that
    publishes a TTFT but no rate, an arm cut before its second token). `completion` is the
    pace of its whole non-streamed answers against `shape` (None: none seen); the rate
    test never reads it."""

    key: MachineKey
    source: Source
    ttft: LogNormal | None
    gap: LogNormal | None
    sightings: int = 0
    last_seen: float | None = None
    completion: LogNormal | None = None
    shape: Shape = REFERENCE_SHAPE
    memo: dict[int, float | None] = field(default_factory=dict, repr=False, compare=False)
    # The two means, read once: routing and teaching ask for them again and again.
    expected_ttft: float | None = field(init=False, compare=False)
    expected_gap: float | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.expected_ttft = None if self.ttft is None else self.ttft.mean()
        self.expected_gap = None if self.gap is None else self.gap.mean()

    @property
    def expected_rate(self) -> float | None:
        """Tokens per second: 1 / expected gap."""
        gap = self.expected_gap
        return None if gap is None else 1.0 / gap

    @property
    def expected_pace(self) -> float | None:
        """How many times its shape a whole non-streamed answer takes (None: none seen)."""
        pace = self.completion
        return None if pace is None or pace.weight <= 0 else pace.mean()

    def expected_seconds(self, tokens: int) -> float | None:
        """Expected time to a usable answer of `tokens` tokens: the streams' TTFT + tokens
        x gap, joined with what whole answers showed (pace x shape) by the weight of the
        evidence behind each, on the log scale. None unless both TTFT and gap are believed.
        Remembered per token count (beliefs are cached and asked again on every routing
        decision)."""
        memo = self.memo
        if tokens in memo:
            return memo[tokens]
        expected = None
        ttft, gap = self.expected_ttft, self.expected_gap
        if ttft is not None and gap is not None:
            expected = ttft + max(tokens, 0) * gap
            expected = self._joined(expected, tokens)
        if len(memo) < 8:
            memo[tokens] = expected
        return expected

    def _joined(self, streamed: float, tokens: int) -> float:
        """`streamed` (the streams' expectation) joined with the whole answers'. Each side
        weighs what it rests on: the gap belief its prior and stream data, the pace its
        answers (each counted as one stream is). Both are held within the believed range,
        so the logs are finite."""
        pace, gap = self.expected_pace, self.gap
        if pace is None or gap is None or self.completion is None:
            return streamed
        answered = pace * self.shape.seconds(tokens)
        weight_s, weight_c = gap.kappa, self.completion.weight
        log_joint = (
            weight_s * math.log(max(streamed, MIN_BELIEVED_SECONDS))
            + weight_c * math.log(max(answered, MIN_BELIEVED_SECONDS))
        ) / (weight_s + weight_c)
        return duration(log_joint)

    def gap_log_pdf(self, gap: float) -> float | None:
        return None if self.gap is None else self.gap.log_pdf(gap)

    def ttft_log_pdf(self, ttft: float) -> float | None:
        return None if self.ttft is None else self.ttft.log_pdf(ttft)


# --- the ledger -------------------------------------------------------------------------------

_EMPTY: Final[frozenset[str]] = frozenset()
# How long a cached belief is served (see `Ledger.current`).
BELIEF_REFRESH_SECONDS: Final = 1.0
# How long a cached belief is served although sightings were filed since (see `Ledger.file`).
BELIEF_COALESCE_SECONDS: Final = 0.05


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    # Pseudo-counts of data halve every this many seconds of the ledger's clock.
    half_life_seconds: float = 1800.0
    # What a ProviderPolicy's published figure is worth, in observations.
    sheet_weight: float = 3.0
    # What the prior a first sighting seeds for a machine with no published figure is worth.
    learned_weight: float = 1.0
    # Prior spread (sd of the log) around a published or first-seen TTFT and gap.
    ttft_log_sd: float = 0.6
    gap_log_sd: float = 0.5
    # One stream's gaps count for at most this many observations; so does one whole answer.
    stream_weight: float = 8.0
    # The widest predictive log-variance a gap or pace belief answers (see the docstring).
    max_log_var: float = 1.0
    # The data behind one quantity never weighs more than this (after forgetting); also the
    # most one peer's evidence weighs here (`Ledger.hear`).
    max_weight: float = MAX_EVIDENCE_WEIGHT
    # Machines tracked at most (least recently sighted dropped first); sheet priors are
    # bounded by the configuration and kept apart.
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if self.half_life_seconds <= 0:
            raise ValueError("half_life_seconds must be positive")
        if min(self.sheet_weight, self.learned_weight, self.stream_weight) <= 0:
            raise ValueError("weights must be positive")
        if self.max_weight < self.stream_weight:
            raise ValueError("max_weight must be at least stream_weight")
        if min(self.ttft_log_sd, self.gap_log_sd, self.max_log_var) <= 0:
            raise ValueError("prior spreads and max_log_var must be positive")
        if self.max_keys < 1:
            raise ValueError("max_keys must be at least 1")


@dataclass(frozen=True, slots=True)
class _Prior:
    m: float
    kappa: float
    a: float
    b: float

    @classmethod
    def around(cls, value: float, log_sd: float, weight: float, *, mean: bool) -> _Prior:
        """A prior worth `weight` observations whose expected value (mean=True) or median
        (mean=False) is `value`, with a spread of `log_sd` on the log scale."""
        var = log_sd * log_sd
        m = math.log(max(value, MIN_SECONDS))
        if mean:
            m -= 0.5 * var * (1.0 + 1.0 / weight)
        return cls(m, weight, 1.0 + weight / 2.0, var * weight / 2.0)

    @classmethod
    def around_log(cls, m: float, log_sd: float, weight: float) -> _Prior:
        var = log_sd * log_sd
        return cls(m, weight, 1.0 + weight / 2.0, var * weight / 2.0)


@dataclass(slots=True)
class _Stats:
    """Weighted, decaying sufficient statistics of log observations."""

    n: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    at: float = -math.inf

    def decayed(self, now: float, half_life: float) -> tuple[float, float, float]:
        if self.n <= 0:
            return 0.0, 0.0, 0.0
        elapsed = max(0.0, now - self.at)
        factor = 0.5 ** (elapsed / half_life)
        return self.n * factor, self.s1 * factor, self.s2 * factor

    def add(
        self, weight: float, mean: float, var: float, now: float, settings: LedgerSettings
    ) -> None:
        n, s1, s2 = self.decayed(now, settings.half_life_seconds)
        n += weight
        s1 += weight * mean
        s2 += weight * (var + mean * mean)
        if n > settings.max_weight:
            shrink = settings.max_weight / n
            n, s1, s2 = n * shrink, s1 * shrink, s2 * shrink
        self.n, self.s1, self.s2 = n, s1, s2
        self.at = now if self.at == -math.inf else max(self.at, now)

    def posterior(
        self,
        prior: _Prior,
        now: float,
        half_life: float,
        peers: _Stats | None = None,
        cap: float = math.inf,
    ) -> LogNormal:
        """The posterior from the prior and this evidence, and the peers' (other proxy
        pods' evidence about the same machine, when the fleet shares it), all of it capped
        at `cap` pseudo-observations."""
        n, s1, s2 = self.decayed(now, half_life)
        if peers is not None:
            pn, ps1, ps2 = peers.decayed(now, half_life)
            n, s1, s2 = n + pn, s1 + ps1, s2 + ps2
            if n > cap:
                shrink = cap / n
                n, s1, s2 = n * shrink, s1 * shrink, s2 * shrink
        if n <= 1e-9:
            return LogNormal(prior.m, prior.kappa, prior.a, prior.b, 0.0)
        mean = s1 / n
        scatter = max(s2 - n * mean * mean, 0.0)
        kappa = prior.kappa + n
        m = (prior.kappa * prior.m + s1) / kappa
        a = prior.a + n / 2.0
        # A product, not `** 2`: a float power raises OverflowError where a product is inf.
        shift = mean - prior.m
        b = prior.b + scatter / 2.0 + prior.kappa * n * shift * shift / (2.0 * kappa)
        return LogNormal(m, kappa, a, b, n)


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a ledger has seen of one quantity, as shareable numbers: `n` pseudo-observations
    (after forgetting) and the sums of their log values and squared log values."""

    n: float
    s1: float
    s2: float

    @property
    def mean_log(self) -> float:
        return self.s1 / self.n


@dataclass(frozen=True, slots=True)
class MachineEvidence:
    """One machine's evidence as a proxy pod shares it with the fleet (or keeps it across a
    restart): never a prompt or a completion, only numbers."""

    key: MachineKey
    ttft: Evidence | None
    gap: Evidence | None
    sightings: int = 0
    # The pace of its whole non-streamed answers (kept apart from the gaps, SPEC B7).
    completion: Evidence | None = None


def _evidence(stats: _Stats, now: float, half_life: float) -> Evidence | None:
    n, s1, s2 = stats.decayed(now, half_life)
    return Evidence(n, s1, s2) if n > 1e-6 else None


def _stats_of(evidence: Evidence | None, weight: float, now: float, cap: float) -> _Stats:
    """`evidence` at `weight`, its count held at `cap` (the ledger's own never weighs more)."""
    if evidence is None or not weight > 0 or not evidence.n > 0:
        return _Stats()
    scale = weight * min(1.0, cap / evidence.n)
    return _Stats(evidence.n * scale, evidence.s1 * scale, evidence.s2 * scale, now)


@dataclass(frozen=True, slots=True)
class _Sheet:
    ttft: _Prior | None
    gap: _Prior | None
    # The published figures themselves (a reference for any not published): what a whole
    # answer's pace is read against.
    shape: Shape = REFERENCE_SHAPE


@dataclass(slots=True)
class _Entry:
    ttft: _Stats
    gap: _Stats
    completion: _Stats = field(default_factory=lambda: _Stats())
    # Priors seeded by the first sighting of each part: used when no sheet figure exists
    # (for the pace, always: nothing publishes one).
    ttft_prior: _Prior | None = None
    gap_prior: _Prior | None = None
    completion_prior: _Prior | None = None
    sightings: int = 0
    last_seen: float | None = None


class _Heard(NamedTuple):
    """What the fleet said about one machine, summed over peers."""

    ttft: _Stats
    gap: _Stats
    completion: _Stats


class _HeardPriors(NamedTuple):
    """Priors seeded from the fleet's word, for a machine this pod has none of its own for."""

    ttft: _Prior | None
    gap: _Prior | None
    completion: _Prior | None


_NO_PRIORS: Final = _HeardPriors(None, None, None)


def _heard_prior(stats: _Stats, log_sd: float, weight: float) -> _Prior | None:
    if not stats.n > 1e-6:
        return None
    return _Prior.around_log(stats.s1 / stats.n, log_sd, weight)


def _published_shape(machine: CompiledMachine) -> Shape:
    """A machine's published TTFT and gap, each the reference's where not published."""
    ttft = machine.ttft_seconds
    rate = machine.tokens_per_second
    return Shape(
        REFERENCE_TTFT if ttft is None else max(ttft, MIN_PUBLISHED_TTFT),
        REFERENCE_GAP if rate is None or not rate > 0 else 1.0 / rate,
    )


class Ledger:
    """Every belief of one proxy process. Pure: `now` (seconds, one clock throughout) is
    passed in; nothing sleeps. Not thread-safe; the proxy's event loop is its only caller.

    `load_sheet(config)` (re)reads the published figures; `note(sighting)` files an arm's
    measurement; `belief(...)` reads one machine's belief at a moment; `machines(...)`
    lists every machine of a (provider, model) that has a belief, including those known
    only from sightings."""

    def __init__(self, settings: LedgerSettings | None = None) -> None:
        self.settings = settings or LedgerSettings()
        self._sheet: dict[MachineKey, _Sheet] = {}
        self._entries: OrderedDict[MachineKey, _Entry] = OrderedDict()
        # (provider, model) -> its machines, the most recently sighted last.
        self._index: dict[tuple[str, str], dict[str, None]] = {}
        # (provider, model, machine) -> (when computed, the belief then); see `current`.
        self._cache: dict[MachineKey, tuple[float, MachineBelief | None]] = {}
        # Cached beliefs with sightings filed since they were computed.
        self._stale: set[MachineKey] = set()
        # The fleet's evidence (other proxy pods'), replaced whole by `hear`: (ttft, gap)
        # statistics and, for machines this pod has no prior for, priors seeded from it.
        self._peers: dict[MachineKey, _Heard] = {}
        self._peer_priors: dict[MachineKey, _HeardPriors] = {}
        # What changed when, for readers that keep what they derived (the chooser's
        # standings): every filed sighting, sheet, restore and hearing counts.
        self.versions = Versions()

    def __len__(self) -> int:
        """Machines with sightings held (bounded by `max_keys`)."""
        return len(self._entries)

    # -- the sheet ------------------------------------------------------------------------

    def load_sheet(self, config: ProxyConfig) -> None:
        """Seed priors from every machine's published figures. A reload replaces the
        sheet; what was learned is kept (a machine dropped from the sheet keeps its
        learned prior)."""
        settings = self.settings
        sheet: dict[MachineKey, _Sheet] = {}
        for provider in config.providers:
            for model in provider.models:
                for machine in model.machines:
                    ttft = gap = None
                    if machine.ttft_seconds is not None:
                        ttft = _Prior.around(
                            max(machine.ttft_seconds, MIN_PUBLISHED_TTFT),
                            settings.ttft_log_sd,
                            settings.sheet_weight,
                            mean=True,
                        )
                    if machine.tokens_per_second is not None and machine.tokens_per_second > 0:
                        gap = _Prior.around(
                            1.0 / machine.tokens_per_second,
                            settings.gap_log_sd,
                            settings.sheet_weight,
                            mean=True,
                        )
                    if ttft is not None or gap is not None:
                        key = MachineKey(provider.name, model.name, machine.name)
                        sheet[key] = _Sheet(ttft, gap, _published_shape(machine))
        for key in self._sheet:
            if key not in sheet and key not in self._entries and key not in self._peers:
                self._unindex(key)
        self._sheet = sheet
        self._cache.clear()
        self._stale.clear()
        self.versions.changed_all()
        for key in sheet:
            self._indexed(key)

    # -- reading --------------------------------------------------------------------------

    def belief(self, provider: str, model: str, machine: str, now: float) -> MachineBelief | None:
        """The belief about one machine at `now` (forgetting applied, every sighting filed
        counted), or None when nothing was ever published or seen about it. Routing reads
        `current`, which is cached."""
        return self.belief_of(MachineKey(provider, model, machine), now)

    def current(self, key: MachineKey, now: float) -> MachineBelief | None:
        """`belief` by key. Read for every machine on every routing decision, so it is
        cached per machine: for BELIEF_REFRESH_SECONDS (forgetting runs on a half-life of
        minutes, so a second-old posterior differs by well under 0.1 %), or until a new
        sheet, or until a sighting is filed, but not sooner than BELIEF_COALESCE_SECONDS
        after it was computed (see `file`); a machine's first belief is served at once."""
        cached = self._cache.get(key)
        if cached is not None:
            age = now - cached[0]
            if 0.0 <= age < BELIEF_REFRESH_SECONDS and (
                key not in self._stale or (age < BELIEF_COALESCE_SECONDS and cached[1] is not None)
            ):
                return cached[1]
        return self._cached(key, self.belief_of(key, now), now)

    def _cached(
        self, key: MachineKey, belief: MachineBelief | None, now: float
    ) -> MachineBelief | None:
        if len(self._cache) >= 2 * self.settings.max_keys:
            # Bounded: machines no longer asked about fall out.
            self._cache.clear()
            self._stale.clear()
        self._cache[key] = (now, belief)
        self._stale.discard(key)
        return belief

    def belief_of(self, key: MachineKey, now: float) -> MachineBelief | None:
        sheet = self._sheet.get(key)
        entry = self._entries.get(key)
        settings = self.settings
        half_life = settings.half_life_seconds
        ttft_prior = sheet.ttft if sheet is not None and sheet.ttft is not None else None
        gap_prior = sheet.gap if sheet is not None and sheet.gap is not None else None
        pace_prior = None
        if entry is not None:
            ttft_prior = ttft_prior or entry.ttft_prior
            gap_prior = gap_prior or entry.gap_prior
            pace_prior = entry.completion_prior
        peers = self._peers.get(key)
        if peers is not None and (ttft_prior is None or gap_prior is None or pace_prior is None):
            seeded = self._peer_priors.get(key, _NO_PRIORS)
            ttft_prior, gap_prior = ttft_prior or seeded.ttft, gap_prior or seeded.gap
            pace_prior = pace_prior or seeded.completion
        if ttft_prior is None and gap_prior is None and pace_prior is None:
            return None
        empty = _Stats()
        peer = peers if peers is not None else _Heard(empty, empty, empty)
        cap = settings.max_weight
        shape = sheet.shape if sheet is not None else REFERENCE_SHAPE
        completion = None
        if pace_prior is not None:
            stats = entry.completion if entry is not None else empty
            completion = stats.posterior(pace_prior, now, half_life, peer.completion, cap)
            completion = completion.bounded(settings.max_log_var)
            # Known from whole answers alone: stand-in priors for what streams would show,
            # the answers' pace times the shape, each worth a first sighting. Priors, not
            # data: the first stream's gaps outweigh them.
            stand_in = _Prior.around(
                completion.mean() * shape.ttft, settings.ttft_log_sd,
                settings.learned_weight, mean=True,
            ) if ttft_prior is None else None  # fmt: skip
            ttft_prior = ttft_prior or stand_in
            if gap_prior is None:
                gap_prior = _Prior.around(
                    completion.mean() * shape.gap, settings.gap_log_sd,
                    settings.learned_weight, mean=True,
                )  # fmt: skip
        ttft = gap = None
        if ttft_prior is not None:
            stats = entry.ttft if entry is not None else empty
            ttft = stats.posterior(ttft_prior, now, half_life, peer.ttft, cap)
        if gap_prior is not None:
            stats = entry.gap if entry is not None else empty
            gap = stats.posterior(gap_prior, now, half_life, peer.gap, cap)
            gap = gap.bounded(settings.max_log_var)
        return MachineBelief(
            key,
            Source.SHEET if sheet is not None else Source.LEARNED,
            ttft,
            gap,
            entry.sightings if entry is not None else 0,
            entry.last_seen if entry is not None else None,
            completion,
            shape,
        )

    def machine_set(self, provider: str, model: str) -> KeysView[str] | frozenset[str]:
        """The machines of (provider, model) with a belief, as a set (do not modify)."""
        machines = self._index.get((provider, model))
        return _EMPTY if machines is None else machines.keys()

    def recent_machines(
        self, provider: str, model: str, limit: int, leaving_out: Container[str]
    ) -> list[str]:
        """The `limit` machines of (provider, model) sighted most recently, leaving out
        those in `leaving_out` (the sheet's), most recent first."""
        found: list[str] = []
        for machine in reversed(self._index.get((provider, model), {})):
            if machine not in leaving_out:
                found.append(machine)
                if len(found) >= limit:
                    break
        return found

    def machines(self, provider: str, model: str) -> tuple[str, ...]:
        """Every machine of (provider, model) with a belief, sheet or learned, by name."""
        return tuple(sorted(self._index.get((provider, model), ())))

    def keys(self) -> Iterator[MachineKey]:
        """Every machine with a belief, in key order."""
        for (provider, model), machines in sorted(self._index.items()):
            for machine in sorted(machines):
                yield MachineKey(provider, model, machine)

    def beliefs(self, now: float) -> list[MachineBelief]:
        """Every belief at `now`, in key order (for the state the proxy exposes)."""
        found = (self.belief_of(key, now) for key in self.keys())
        return [belief for belief in found if belief is not None]

    # -- learning -------------------------------------------------------------------------

    def note(self, sighting: Sighting) -> MachineBelief | None:
        """`file` one arm's measurement and return the belief afterwards."""
        self.file(sighting)
        key = sighting.key
        return self._cached(key, self.belief_of(key, sighting.at), sighting.at)

    def file(self, sighting: Sighting) -> None:
        """File one arm's measurement. Any arm may file: the winner, a race's loser, an arm
        that errored, was cut or was abandoned.

        The belief is not recomputed here but at its next read (`current`), and a read
        within BELIEF_COALESCE_SECONDS of the last computation is served that one: a
        machine answering a thousand requests a second is recomputed twenty times a second,
        not once per answer, and a routing decision sees a sighting at most that late. (A
        machine nothing was believed about is known from its first sighting on.)"""
        if not sighting.teaches:
            return
        key = sighting.key
        self.versions.changed(key.provider, key.model, sighting.at)
        if key in self._cache:
            self._stale.add(key)
        settings = self.settings
        now = sighting.at
        entry = self._entry(key)
        entry.sightings += 1
        entry.last_seen = now if entry.last_seen is None else max(entry.last_seen, now)
        sheet = self._sheet.get(key)

        # Time to first token: exact, or censored at the moment the arm was given up on.
        if sighting.ttft is not None or sighting.waited:
            seen = sighting.ttft if sighting.ttft is not None else sighting.waited
            assert seen is not None
            # Held within the plausible range (core/plausible.py): a first token within a
            # millisecond counts as a millisecond, a wait past an hour as an hour.
            y = TTFT_LOG.clamp(math.log(max(seen, MIN_SECONDS)))
            # The first word about this machine's TTFT seeds a weak prior centred on it (for
            # a censored wait, on the wait itself: a lower bound, so an underestimate). It
            # serves when the sheet has no figure, or stops having one.
            fresh = entry.ttft_prior is None
            if entry.ttft_prior is None:
                entry.ttft_prior = _Prior.around_log(
                    y, settings.ttft_log_sd, settings.learned_weight
                )
            sheet_prior = sheet.ttft if sheet is not None else None
            prior = sheet_prior or entry.ttft_prior
            if sighting.ttft is not None or (fresh and sheet_prior is None):
                entry.ttft.add(1.0, y, 0.0, now, settings)
            else:
                current = entry.ttft.posterior(prior, now, settings.half_life_seconds)
                if y > current.m:
                    imputed = truncated_mean(current.m, current.log_sd, y)
                    # Never below the wait (nor a NaN), never past the range.
                    imputed = TTFT_LOG.clamp(imputed if imputed >= y else y)
                    entry.ttft.add(1.0, imputed, 0.0, now, settings)

        # Per-token gaps: one stream is worth at most stream_weight observations.
        gaps = sighting.gaps
        mean, var = gaps.mean_log, gaps.var_log
        if mean is not None and var is not None:
            # GapStats.add holds each gap within range; these hold any GapStats made whole.
            mean = GAP_LOG.clamp(mean)
            var = min(var, GAP_LOG.max_variance)
            weight = min(gaps.count, settings.stream_weight)
            if entry.gap_prior is None:
                entry.gap_prior = _Prior.around_log(
                    mean, settings.gap_log_sd, settings.learned_weight
                )
            entry.gap.add(weight, mean, var, now, settings)

        # A whole non-streamed answer: its pace, in a belief of its own (never gaps).
        if sighting.completed is not None:
            self._file_completion(entry, key, sighting.completed, now)

    def _file_completion(
        self, entry: _Entry, key: MachineKey, completed: Completed, now: float
    ) -> None:
        """File one whole answer's pace: its time over its machine's shape for its tokens,
        one observation worth as much as one stream's gaps (it is the sum of as many)."""
        settings = self.settings
        sheet = self._sheet.get(key)
        shape = sheet.shape if sheet is not None else REFERENCE_SHAPE
        seconds = max(completed.seconds, MIN_SECONDS)
        y = PACE_LOG.clamp(math.log(seconds / shape.seconds(completed.tokens)))
        if entry.completion_prior is None:
            entry.completion_prior = _Prior.around_log(
                y, settings.gap_log_sd, settings.learned_weight
            )
        weight = min(float(max(completed.tokens, 1)), settings.stream_weight)
        entry.completion.add(weight, y, 0.0, now, settings)

    # -- the fleet's memory ----------------------------------------------------------------

    def evidence(self, now: float) -> list[MachineEvidence]:
        """This ledger's own evidence (never what it heard from peers: a pod shares only
        what it saw, so nobody counts anything twice), forgotten down to `now`, most
        recently sighted first."""
        half_life = self.settings.half_life_seconds
        found = []
        for key, entry in reversed(self._entries.items()):
            ttft = _evidence(entry.ttft, now, half_life)
            gap = _evidence(entry.gap, now, half_life)
            completion = _evidence(entry.completion, now, half_life)
            if ttft is not None or gap is not None or completion is not None:
                found.append(MachineEvidence(key, ttft, gap, entry.sightings, completion))
        return found

    def restore(self, evidence: Iterable[MachineEvidence], age: float, now: float) -> None:
        """Take back this pod's own evidence, kept `age` seconds ago (a restart): forgotten
        for the time it spent on the shelf, then as if it had been seen here."""
        factor = 0.5 ** (max(age, 0.0) / self.settings.half_life_seconds)
        settings = self.settings
        cap = settings.max_weight
        for item in evidence:
            entry = self._entry(item.key)
            entry.ttft = _stats_of(item.ttft, factor, now, cap)
            entry.gap = _stats_of(item.gap, factor, now, cap)
            entry.completion = _stats_of(item.completion, factor, now, cap)
            entry.sightings = max(entry.sightings, item.sightings)
            if item.ttft is not None and entry.ttft_prior is None:
                entry.ttft_prior = _Prior.around_log(
                    item.ttft.mean_log, settings.ttft_log_sd, settings.learned_weight
                )
            if item.gap is not None and entry.gap_prior is None:
                entry.gap_prior = _Prior.around_log(
                    item.gap.mean_log, settings.gap_log_sd, settings.learned_weight
                )
            if item.completion is not None and entry.completion_prior is None:
                entry.completion_prior = _Prior.around_log(
                    item.completion.mean_log, settings.gap_log_sd, settings.learned_weight
                )
        self._cache.clear()
        self._stale.clear()
        self.versions.changed_all()

    def hear(self, peers: Iterable[tuple[MachineEvidence, float]], now: float) -> None:
        """Replace what the fleet said: each peer's evidence with the weight it carries
        (its age's forgetting, times any discount), summed per machine. A machine only
        peers have seen becomes a candidate here too, with a prior seeded from them.

        One peer's evidence of one quantity weighs at most `max_weight` observations (what
        this ledger's own may weigh), whatever count it claims: a peer moves a belief only
        as far as a sample that size allows, never as far as a billion claimed ones."""
        settings = self.settings
        cap = settings.max_weight
        heard: dict[MachineKey, _Heard] = {}
        for item, weight in peers:
            if not weight > 0:
                continue
            stats = heard.get(item.key)
            if stats is None:
                stats = heard[item.key] = _Heard(_Stats(at=now), _Stats(at=now), _Stats(at=now))
            for into, part in zip(stats, (item.ttft, item.gap, item.completion), strict=True):
                if part is not None and part.n > 0:
                    scale = weight * min(1.0, cap / part.n)
                    into.n += part.n * scale
                    into.s1 += part.s1 * scale
                    into.s2 += part.s2 * scale
        priors = {
            key: _HeardPriors(
                _heard_prior(stats.ttft, settings.ttft_log_sd, settings.learned_weight),
                _heard_prior(stats.gap, settings.gap_log_sd, settings.learned_weight),
                _heard_prior(stats.completion, settings.gap_log_sd, settings.learned_weight),
            )
            for key, stats in heard.items()
        }
        for key in self._peers:
            if key not in heard and key not in self._sheet and key not in self._entries:
                self._unindex(key)
        self._peers, self._peer_priors = heard, priors
        for key in heard:
            self._indexed(key)
        self.versions.changed_all()
        self._cache.clear()
        self._stale.clear()

    # -- bookkeeping ----------------------------------------------------------------------

    def _entry(self, key: MachineKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._indexed(key)  # (sighted again: the most recent of its model's)
            return entry
        entry = self._entries[key] = _Entry(_Stats(), _Stats())
        self._indexed(key)
        while len(self._entries) > self.settings.max_keys:
            victim, _ = self._entries.popitem(last=False)
            self._cache.pop(victim, None)
            self._stale.discard(victim)
            if victim not in self._sheet and victim not in self._peers:
                self._unindex(victim)
            self.versions.changed(victim.provider, victim.model, -math.inf)
        return entry

    def _indexed(self, key: MachineKey) -> None:
        machines = self._index.setdefault((key.provider, key.model), {})
        machines.pop(key.machine, None)
        machines[key.machine] = None

    def _unindex(self, key: MachineKey) -> None:
        machines = self._index.get((key.provider, key.model))
        if machines is None:
            return
        machines.pop(key.machine, None)
        if not machines:
            del self._index[(key.provider, key.model)]
