"""The one place an arm's end is recorded: every sink is fed from its `ArmEnd`, here and
nowhere else.

* the breaker: the upstream's faults and its answers, never what the client, we or our
  connection pool did (SPEC A5);
* the ledger: what the arm taught (`core.arm_end.sighting`, SPEC B7), streamed or not;
* the verdict log and the verdict metrics (SPEC A4, A9);
* the request's decision: the arm's row (SPEC C8); for the arm that served, what was served,
  its tokens and its cost (through the ranking's cost rule), and the affinity pin of its
  machine (SPEC B3);
* the attempt-failure metric.

Synchronous and O(1): no I/O, no await. The outcome channel takes the finished decision
later (app.py) and feeds the score from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rolegate_policy.config import CompiledMachine, ProxyConfig
from rolegate_policy.status import ProtocolQuirk

from ..core.arm_end import ArmEnd, Cause, arm_row, breaker_input, sighting
from ..core.beliefs import Ledger, MachineKey
from ..core.breaker import Breakers
from ..core.chooser import Chooser
from ..core.decisions import Decision
from ..core.exclusions import Transition
from ..core.outcomes import OutcomeKind
from ..core.ranking import expected_cost
from ..core.verdicts import VerdictKind, VerdictLog, VerdictRow
from ..core.watch import Act
from .metrics import ProxyMetrics

log = logging.getLogger("rolegate.proxy")


class Recorder:
    def __init__(
        self,
        breakers: Breakers,
        ledger: Ledger,
        chooser: Chooser,
        verdicts: VerdictLog,
        metrics: ProxyMetrics,
    ) -> None:
        self.breakers = breakers
        self.ledger = ledger
        self.chooser = chooser
        self.verdicts = verdicts
        self.metrics = metrics
        self.listeners: list[Callable[[Transition], None]] = []
        # (provider, quirk) -> [answers that showed it, when last seen]: the status notes.
        self._quirks: dict[tuple[str, ProtocolQuirk], list[float]] = {}
        # The configuration last answered under, and its machines by (provider, model,
        # machine) (see `_sheet`).
        self._sheets: tuple[ProxyConfig | None, dict[tuple[str, str, str], CompiledMachine]] = (
            None,
            {},
        )

    # The monotonic clock itself, not a method around it: asked a dozen times a request.
    now = staticmethod(time.monotonic)

    def record(self, end: ArmEnd, decision: Decision, patience: float) -> None:
        now = self.now()
        attempted = breaker_input(end)
        if attempted is not None and (transitions := self.breakers.record(attempted, now)):
            self.transitions(transitions)
        key = None if end.machine is None else MachineKey(end.provider, end.model, end.machine)
        if key is not None:
            taught = sighting(end, self.ledger.current(key, now))
            if taught is not None:
                self.ledger.file(taught)
        self._verdict(end)
        if end.cause is not Cause.ANSWERED:
            self.metrics.attempt_failures.labels(end.provider, end.cause.value).inc()
        decision.arm(arm_row(end, patience, decision.started_at))
        if end.cause is Cause.ANSWERED and key is not None:
            # Affinity (SPEC B3): the machine that answered leads the role's next order.
            self.chooser.affinity.answered(decision.role, key)

    def served(
        self,
        end: ArmEnd,
        decision: Decision,
        patience: float,
        config: ProxyConfig,
        *,
        recorded: bool = False,
    ) -> None:
        """The arm whose answer reached the client: recorded (unless it was, as a broken
        stream whose rescue failed), and the request's outcome."""
        if not recorded:
            self.record(end, decision, patience)
        decision.served_provider = end.provider
        # The configured model name: bounded label values, and the key scores are kept by.
        decision.served_model = end.model
        decision.served_machine = end.machine if end.named or end.direct else None
        decision.verdict = end.verdict.kind.value if end.verdict is not None else None
        answer = end.answer
        if answer is not None:
            decision.finish_reason = answer.finish_reason
            decision.tokens_in = answer.prompt_tokens
            decision.tokens_out = answer.completion_tokens
            if answer.completion_tokens is None and end.streamed:
                decision.tokens_out = answer.estimated_tokens
                decision.tokens_estimated = True
        decision.cost_usd = _cost(
            self._sheet(config, end.provider, end.model, end.machine),
            decision.tokens_in,
            decision.tokens_out,
        )
        if end.cause is not Cause.ANSWERED:
            decision.outcome = OutcomeKind.INCOMPLETE
        elif decision.first_content_at is None:
            decision.first_content_at = end.ended_at if end.first_at is None else end.first_at

    def _sheet(
        self, config: ProxyConfig, provider: str, model: str, machine: str | None
    ) -> CompiledMachine | None:
        """The configured machine serving `model` at `provider` (its published prices),
        from an index of `config` made at its first answer: a model may list hundreds of
        machines, and every answer's cost looks its machine up."""
        held, sheets = self._sheets
        if held is not config:
            sheets = {}
            for serving in config.providers:
                for served in serving.models:
                    for sheet in served.machines:
                        # The first of a name, as a lookup by name finds it.
                        sheets.setdefault((serving.name, served.name, sheet.name), sheet)
            self._sheets = (config, sheets)
        return None if machine is None else sheets.get((provider, model, machine))

    def _verdict(self, end: ArmEnd) -> None:
        verdict = end.verdict
        if verdict is None:
            return
        self.metrics.observe_verdict(end.provider, end.model, verdict)
        if verdict.kind is not VerdictKind.OK:
            row = VerdictRow.of(
                verdict,
                provider=end.provider,
                model=end.model,
                machine=end.machine if end.named or end.direct else None,
                at=time.time(),
            )
            self.verdicts.append(row)

    def noticed(self, provider: str, quirk: ProtocolQuirk) -> None:
        """A provider's answer departed from the protocol in a way rolegate repairs or
        tolerates (SPEC A1, E4): counted and noted on its status, never a fault."""
        self.metrics.quirks[quirk].labels(provider).inc()
        seen = self._quirks.setdefault((provider, quirk), [0, 0.0])
        seen[0] += 1
        seen[1] = self.now()

    def quirks_of(self, provider: str) -> dict[ProtocolQuirk, tuple[int, float]]:
        """The quirks seen in `provider`'s answers: how many, and when last (monotonic)."""
        return {
            quirk: (int(seen[0]), seen[1])
            for (name, quirk), seen in self._quirks.items()
            if name == provider
        }

    def act(self, role: str, act: Act, done: str) -> None:
        """A rate act and what was made of it: raced, continued, or kept."""
        self.metrics.acts.labels(role, act.reason.value, done).inc()

    def transitions(self, transitions: list[Transition] | tuple[Transition, ...]) -> None:
        """Breaker transitions, wherever they happened: logged, counted, and handed to the
        listeners (the status reporter)."""
        for transition in transitions:
            log.warning(
                "breaker %s key=%r cause=%s reason=%s trigger=%s",
                transition.kind.value,
                transition.key.describe(),
                transition.cause.value,
                transition.reason.value,
                transition.trigger.value if transition.trigger else "-",
            )
            self.metrics.on_transition(transition)
            for listener in self.listeners:
                listener(transition)
        if transitions:
            self.metrics.observe_breakers(self.breakers.snapshot(self.now()))


def _cost(
    sheet: CompiledMachine | None, tokens_in: int | None, tokens_out: int | None
) -> float | None:
    """USD from the serving machine's published prices (the ranking's cost rule)."""
    if sheet is None or tokens_in is None or tokens_out is None:
        return None
    return expected_cost(
        sheet.price_input_per_mtok, sheet.price_output_per_mtok, tokens_in, tokens_out
    )
