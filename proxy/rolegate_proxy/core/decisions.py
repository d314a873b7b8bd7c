"""What the proxy decided for a request and why (SPEC A9, C8): routing metadata only.

A `Decision` is built while a request is routed: every candidate or machine skipped and
why (a breaker, a rate limit, the role's patience, a request fault that made the rest
pointless), and every upstream attempt (an `Arm`) with how it ended. When the request
finishes, `Decision.finish` turns it into the request's one `Outcome` for the outcome
channel. The `DecisionLog` is one of the channel's consumers: the recent outcomes, which
`GET /v1/rolegate/decisions` serves. Never any prompt or completion text.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .outcomes import Arm, Outcome, OutcomeKind, Skip
from .trace_ids import TraceIds


@dataclass(slots=True)
class Decision:
    request_id: str
    role: str
    ruling: str
    # Monotonic, like every clock of the dispatcher.
    started_at: float
    stream: bool = False
    patience_seconds: float | None = None
    # The AccessGrant the request is counted against (`namespace/name`).
    grant: str | None = None
    started_wall: float = field(default_factory=time.time)
    arms: list[Arm] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    served_provider: str | None = None
    served_model: str | None = None
    served_machine: str | None = None
    outcome: OutcomeKind | None = None
    finish_reason: str | None = None
    verdict: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_estimated: bool = False
    cost_usd: float | None = None
    # Monotonic time the first content byte was written to the client.
    first_content_at: float | None = None
    # rolegate's error code when the error went out as an event (a buffered stream the
    # keep-alives had committed), not as the response's status.
    error_code: str | None = None
    # Where the request's span belongs in its trace, when tracing is on.
    trace: TraceIds | None = None

    @property
    def attempts(self) -> int:
        return len(self.arms)

    def skip(self, provider: str, model: str, machine: str | None, reason: str) -> None:
        self.skips.append(Skip(provider, model, machine, reason))

    def arm(self, arm: Arm) -> None:
        self.arms.append(arm)

    def skipped_reasons(self) -> list[str]:
        return [
            f"{skip.provider}/{skip.model}"
            + (f"@{skip.machine}" if skip.machine else "")
            + f": {skip.reason}"
            for skip in self.skips
        ]

    def finish(
        self,
        *,
        outcome: OutcomeKind,
        status: int,
        now: float,
        config_hash: str,
        error_code: str | None = None,
    ) -> Outcome:
        """The request's outcome record. `outcome` is the caller's view (answered unless
        the dispatcher already knew better, e.g. incomplete)."""
        kind = (
            self.outcome
            if self.outcome is not None and outcome is OutcomeKind.ANSWERED
            else outcome
        )
        ttft = None if self.first_content_at is None else self.first_content_at - self.started_at
        # Positional, in the fields' order: passed by keyword, two dozen fields cost more
        # to match by name than to make the record.
        return Outcome(
            self.request_id,  # request_id
            self.role,  # role
            kind,  # outcome
            status,  # status
            self.stream,  # stream
            self.started_wall,  # started_at
            now - self.started_at,  # latency_seconds
            ttft,  # ttft_seconds
            self.ruling,  # ruling
            self.patience_seconds,  # patience_seconds
            self.grant,  # grant
            self.served_provider,  # provider
            self.served_model,  # model
            self.served_machine,  # machine
            self.finish_reason,  # finish_reason
            self.verdict,  # verdict
            self.tokens_in,  # tokens_in
            self.tokens_out,  # tokens_out
            self.tokens_estimated,  # tokens_estimated
            self.cost_usd,  # cost_usd
            tuple(self.arms),  # arms
            tuple(self.skips),  # skipped
            config_hash,  # config_hash
            error_code or self.error_code,  # error_code
            self.trace,  # trace
        )


class DecisionLog:
    """The most recent outcomes, fed by the outcome channel; O(1) per record, the oldest
    fall off."""

    def __init__(self, maxlen: int = 2000) -> None:
        self._items: deque[Outcome] = deque(maxlen=maxlen)

    def __call__(self, batch: Sequence[Outcome]) -> None:
        self._items.extend(batch)

    def recent(self, *, role: str | None = None, request_id: str | None = None) -> list[Outcome]:
        """Oldest first, optionally only one role's or one request's."""
        return [
            outcome
            for outcome in self._items
            if (role is None or outcome.role == role)
            and (request_id is None or outcome.request_id == request_id)
        ]

    def __iter__(self) -> Iterator[Outcome]:
        return iter(self._items)
