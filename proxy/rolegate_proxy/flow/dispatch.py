"""One client request from start to answer: candidates, exclusions, attempts, verdicts.

For each candidate (a model of the role on a provider serving it, in the role's order):
the breaker says which machines may be sent to; refused machines go to the aggregator's
`ignore` (a direct provider is skipped); an attempt is sent; its outcome is recorded in the
breaker whatever it was. A failure before content reached the client moves on: to another
machine of the same model (the failing one is ignored), then to the next candidate, with
a short jittered backoff and never past the role's patience. A 400 is never resent
unchanged to the same model: context length moves on to a later model, a content-filter
refusal goes back to the caller as it is, any other 400 too. Every candidate is noted in
the request's decision with what happened to it and why.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from aiohttp import web

from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.enums import (
    Dialect,
)

from ..core.beliefs import GapStats, Ledger, MachineKey, Sighting
from ..core.breaker import Attempted, Breakers, TransportFault
from ..core.chooser import Chooser
from ..core.decisions import Decision
from ..core.exclusions import (
    Transition,
    parse_retry_after,
)
from ..core.outcomes import Arm, ArmAct, ArmResult, OutcomeKind
from ..core.routing import Attempt, Candidate, plan_candidates
from ..core.score import Scoreboard
from ..core.verdicts import Verdict, VerdictKind, VerdictLog, VerdictRow, judge
from ..core.watch import Watch
from ..wire.chat_request import ChatRequest
from ..wire.errors import ProxyError
from .metrics import ProxyMetrics
from .relay import (
    Answer,
    OpenStream,
    RelayContext,
    Served,
    StreamEnd,
    complete_once,
    continue_stream,
    open_stream,
    relay_stream,
    resume_stream,
)
from .upstream import RequestFault, UpstreamFailure

log = logging.getLogger("rolegate.proxy")

# Attempts on one candidate (each ignoring the machines that failed before) and in all.
MAX_TRIES_PER_CANDIDATE = 3
MAX_ATTEMPTS = 8
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 1.0
# The share of a role's patience one silent attempt may use while others could answer.
IDLE_SHARE = 0.5


@dataclass
class Dispatcher:
    """Per-process routing state the requests share: the breakers and the logs."""

    breakers: Breakers
    verdicts: VerdictLog
    rng: random.Random
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    # What each machine is believed to do, and who may be sent to (SPEC B1-B4, B7).
    ledger: Ledger = field(default_factory=Ledger)
    # Each machine's operational and semantic quality (SPEC C1-C3), fed by the outcomes.
    scores: Scoreboard = field(default_factory=Scoreboard)
    # The share of routing decisions that explore (a machine other than the best leads).
    explore: float = 0.02
    chooser: Chooser = field(init=False)

    def __post_init__(self) -> None:
        self.chooser = Chooser(
            self.ledger, scores=self.scores, draw=self.rng.random, explore=self.explore
        )

    listeners: list[Callable[[Transition], None]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic()

    async def handle(
        self,
        request: web.Request,
        chat: ChatRequest,
        config: ProxyConfig,
        ctx: RelayContext,
        decision: Decision,
    ) -> web.StreamResponse:
        deadline = decision.started_at + chat.role.patience_seconds
        failures: list[UpstreamFailure] = []
        candidates = self.chooser.order_candidates(
            chat.role,
            plan_candidates(chat.role, config),
            self.breakers.exclusion,
            self.now(),
            prompt_tokens=chat.prompt_tokens,
        )
        skip_model: set[str] = set()
        attempts_left = MAX_ATTEMPTS
        for index, candidate in enumerate(candidates):
            provider, model = candidate.provider.name, candidate.model.name
            if model in skip_model:
                decision.skip(provider, model, None, "the model's context is too small")
                continue
            failed_machines: list[str] = []
            for _ in range(MAX_TRIES_PER_CANDIDATE):
                remaining = deadline - self.now()
                if remaining <= 0 or attempts_left <= 0:
                    why = "the role's patience ran out" if remaining <= 0 else "attempt limit"
                    for later in candidates[index:]:
                        decision.skip(later.provider.name, later.model.name, None, why)
                    raise self._exhausted(chat, candidates, failures, decision)
                attempt = self._admit(candidate, chat, failed_machines, decision)
                if attempt is None:
                    break
                attempts_left -= 1
                started = self.now()
                # A silent upstream may use half the patience while anything else could
                # still answer, so a fallback has time to; the last candidate gets the rest.
                last = index + 1 == len(candidates) and not candidate.is_aggregator
                budget = (
                    remaining if last else min(remaining, chat.role.patience_seconds * IDLE_SHARE)
                )
                try:
                    return await self._send(
                        request, chat, attempt, ctx, decision, started, budget, config
                    )
                except UpstreamFailure as failure:
                    failures.append(failure)
                    self._record_failure(failure, started)
                    decision.arm(self._failed_arm(failure, started))
                    fault = failure.request_fault
                    if fault is RequestFault.CONTEXT_LENGTH:
                        skip_model.add(model)
                        break
                    if fault is not None:
                        # About the request, not the machine: the caller gets it as it is.
                        raise self._rejected(failure) from None
                    if failure.machine and candidate.is_aggregator:
                        failed_machines.append(failure.machine)
                    else:
                        break  # nothing narrower to avoid: next candidate
                    await self._backoff(len(failures), deadline)
            if index + 1 < len(candidates) and failures:
                await self._backoff(len(failures), deadline)
        if not failures:
            # Nothing was sendable. B4: an empty admitted set falls back to an `order` of
            # the machines refused only for patience (a slow answer beats none); machines
            # under a hard exclusion are never sent to.
            plan = self.chooser.plan(chat.role, candidates, self.breakers.exclusion, self.now())
            resort = plan.last_resort()
            match = [
                c
                for c in candidates
                if resort is not None
                and (c.provider.name, c.model.name) == (resort.provider, resort.model)
            ]
            if resort is not None and match and deadline > self.now():
                attempt = Attempt(match[0].provider, match[0].model, resort.routing)
                started = self.now()
                try:
                    return await self._send(
                        request, chat, attempt, ctx, decision, started, deadline - started, config
                    )
                except UpstreamFailure as failure:
                    failures.append(failure)
                    self._record_failure(failure, started)
                    decision.arm(self._failed_arm(failure, started))
        raise self._exhausted(chat, candidates, failures, decision)

    def _admit(
        self,
        candidate: Candidate,
        chat: ChatRequest,
        failed_machines: list[str],
        decision: Decision,
    ) -> Attempt | None:
        provider, model = candidate.provider.name, candidate.model.name
        now = self.now()
        choice = self.chooser.choose(
            chat.role,
            candidate,
            self.breakers.exclusion,
            now,
            avoid=failed_machines,
            prompt_tokens=chat.prompt_tokens,
        )
        for fate in (f for f in choice.fates if not f.admitted):
            machine = fate.machine if candidate.is_aggregator else None
            decision.skip(provider, model, machine, f"{fate.reason}: {fate.detail}")
        if not choice.sendable:
            # Never an empty `only`, never an order of nobody: the candidate is skipped.
            decision.skip(provider, model, None, choice.skip_reason or "no machine admitted")
            return None
        # Takes half-open probe slots for the keys covering this candidate.
        admission = self.breakers.admit(provider, model, None, now)
        if not admission.allowed:
            assert admission.exclusion is not None
            decision.skip(provider, model, None, admission.exclusion.describe())
            return None
        return Attempt(candidate.provider, candidate.model, choice.routing)

    async def _send(
        self,
        request: web.Request,
        chat: ChatRequest,
        attempt: Attempt,
        ctx: RelayContext,
        decision: Decision,
        started: float,
        budget: float,
        config: ProxyConfig,
    ) -> web.StreamResponse:
        if not chat.stream:
            try:
                completed = await complete_once(chat, attempt, ctx, budget)
            except asyncio.CancelledError:
                # The client left while the upstream worked: the wait still teaches (B7)
                # and the attempt is on the record.
                machine = _presumed_machine(attempt)
                waited = self.now() - started
                self._teach(attempt, machine, waited=waited)
                decision.arm(
                    Arm(attempt.provider.name, attempt.model.name, machine, ArmResult.CANCELLED,
                        None, waited, None, None, "the client went away before the answer")
                )  # fmt: skip
                raise
            verdict = self._judge(chat, completed.answer, attempt)
            if verdict.counts(attempt.provider.degraded_output):
                raise UpstreamFailure(
                    attempt,
                    f"answered 200 but the answer is {verdict.kind.value}"
                    + (f" ({verdict.detail})" if verdict.detail else ""),
                    status=200,
                    machine=_machine(attempt, completed.answer),
                    verdict=verdict,
                )
            self._record_answer(attempt, completed.answer, verdict, started)
            decision.first_content_at = self.now()
            self._served(decision, chat, attempt, completed.answer, verdict, started)
            return completed.response
        presumed = _presumed_machine(attempt)
        watch = self._watch(chat, attempt, presumed, started, decision, config)
        opened, attempt, started = await self._first_content(
            chat, attempt, ctx, budget, watch, decision, config, started
        )
        raced = any(arm.act is ArmAct.RACED for arm in decision.arms)
        provider, model = attempt.provider.name, attempt.model.name
        ttft = opened.first_at - started
        decision.first_content_at = opened.first_at
        served = opened.served.machine or attempt.single_machine
        if served is not None and served != presumed:
            key = MachineKey(provider, model, served)
            watch.identify(key, self.ledger.belief_of(key, self.now()))
        watch.observe(opened.first_at, tokens=1)
        try:
            end = await relay_stream(request, opened, ctx, watch)
        except BaseException:
            # The client left mid-stream: the arm still teaches what it showed.
            self._teach(attempt, opened.served.machine, ttft=ttft, cut=True)
            decision.arm(
                Arm(provider, model, served, ArmResult.CANCELLED, 200, self.now() - started,
                    ttft, ArmAct.RACED if raced else None, "the client went away mid-stream")
            )  # fmt: skip
            raise
        self._teach(
            attempt,
            end.answer.served.machine,
            ttft=ttft,
            gaps=end.gaps,
            cut=end.fault is not None or end.moved is not None,
        )
        act = ArmAct.RACED if raced else None
        if end.moved is not None:
            end, act, started, ttft = await self._move(
                chat, attempt, end, ctx, decision, config, started, ttft
            )
            attempt = end.attempt or attempt
            provider, model = attempt.provider.name, attempt.model.name
        machine = _machine(attempt, end.answer)
        if end.fault is not None:
            # Content had reached the client, which got an error event: the stream counts
            # against the machine, and the request is over.
            self._record(
                Attempted.transport_failure(
                    provider, model, end.fault, machine=machine, started_at=started
                )
            )
            self._served(
                decision, chat, attempt, end.answer, None, started, ttft=ttft, act=act,
                broke=f"stream broke after content: {end.detail}",
            )  # fmt: skip
            decision.outcome = OutcomeKind.INCOMPLETE
            return end.response
        verdict = self._judge(chat, end.answer, attempt)
        self._record_answer(attempt, end.answer, verdict, started)
        self._served(decision, chat, attempt, end.answer, verdict, started, ttft=ttft, act=act)
        return end.response

    async def _first_content(
        self,
        chat: ChatRequest,
        attempt: Attempt,
        ctx: RelayContext,
        budget: float,
        watch: Watch,
        decision: Decision,
        config: ProxyConfig,
        started: float,
    ) -> tuple[OpenStream, Attempt, float]:
        """Wait for the arm's first content. If the rate test calls its first token late
        (a `ttft` act) and a better machine is admissible, race it (SPEC B6): the arm that
        produces content first is kept, the other cancelled; both teach the ledger."""

        def identify(served: Served) -> None:
            if served.machine and attempt.is_aggregator:
                key = MachineKey(attempt.provider.name, attempt.model.name, served.machine)
                if key != watch.serving:
                    watch.identify(key, self.ledger.belief_of(key, self.now()))

        first = asyncio.create_task(open_stream(chat, attempt, ctx, budget, identify))
        tasks = [first]
        try:
            while True:
                check_at = watch.next_check(self.now())
                timeout = None if check_at is None else max(0.0, check_at - self.now())
                done, _ = await asyncio.wait({first}, timeout=timeout)
                if done:
                    return self._opened_or_taught(first, attempt, started), attempt, started
                act = watch.observe(self.now())
                if act is not None and act.movable and act.alternative is not None:
                    break  # a late first token, and a better machine to race
            rival = self._onward(act.alternative.key, config)
            if rival is None:
                opened = self._opened_or_taught(await _settle(first), attempt, started)
                return opened, attempt, started
            race = f"raced ({act.reason.value}): {act.detail}"
            self.metrics.acts.labels(chat.role.name, act.reason.value, "raced").inc()
            rival_started = self.now()
            second = asyncio.create_task(open_stream(chat, rival, ctx, budget))
            tasks.append(second)
            arms = {first: (attempt, started), second: (rival, rival_started)}
            pending = set(arms)
            lost: list[tuple[UpstreamFailure, float]] = []
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    arm, arm_started = arms[task]
                    try:
                        opened = self._opened_or_taught(task, arm, arm_started)
                    except UpstreamFailure as arm_failure:
                        lost.append((arm_failure, arm_started))
                        continue
                    for other in pending:
                        other.cancel()
                        loser, loser_started = arms[other]
                        # The loser of the race still teaches: it had not answered yet.
                        # The first arm's machine is the one its answer named, if it did.
                        named = watch.serving.machine if watch.serving is not None else None
                        machine = named if other is first else _presumed_machine(loser)
                        self._teach(loser, machine, waited=self.now() - loser_started)
                        decision.arm(
                            Arm(loser.provider.name, loser.model.name, machine,
                                ArmResult.CANCELLED, None, self.now() - loser_started, None,
                                ArmAct.RACED, f"lost the race; {race}")
                        )  # fmt: skip
                    for lost_failure, failed_at in lost:
                        self._record_failure(lost_failure, failed_at)
                        decision.arm(self._failed_arm(lost_failure, failed_at, ArmAct.RACED))
                    return opened, arm, arm_started
            # Both arms failed: the caller records the last; the other is recorded here.
            for lost_failure, failed_at in lost[:-1]:
                self._record_failure(lost_failure, failed_at)
                decision.arm(self._failed_arm(lost_failure, failed_at, ArmAct.RACED))
            raise lost[-1][0]
        except BaseException as error:
            for task in tasks:
                task.cancel()
            if isinstance(error, asyncio.CancelledError):
                # The client left before the first token: the wait still teaches (B7).
                named = watch.serving.machine if watch.serving is not None else None
                machine = named or _presumed_machine(attempt)
                self._teach(attempt, machine, waited=self.now() - started)
                decision.arm(
                    Arm(attempt.provider.name, attempt.model.name, machine, ArmResult.CANCELLED,
                        None, self.now() - started, None, None,
                        "the client went away before the first token")
                )  # fmt: skip
            raise

    def _opened_or_taught(
        self, task: asyncio.Task[OpenStream], attempt: Attempt, started: float
    ) -> OpenStream:
        try:
            return task.result()
        except UpstreamFailure as failure:
            # An arm that failed before its first token: how long it was waited on is
            # evidence only when it was a timeout.
            if failure.transport is TransportFault.TIMEOUT:
                machine = failure.machine or _presumed_machine(attempt)
                self._teach(attempt, machine, waited=self.now() - started)
            raise

    def _onward(self, target: MachineKey, config: ProxyConfig) -> Attempt | None:
        """An attempt aimed at exactly one machine (a race's rival, a continuation)."""
        provider = config.provider(target.provider)
        model = provider.model(target.model) if provider is not None else None
        if provider is None or model is None:
            return None
        if provider.dialect is Dialect.AGGREGATOR:
            return Attempt(provider, model, {"only": [target.machine], "allow_fallbacks": False})
        return Attempt(provider, model)

    def _watch(
        self,
        chat: ChatRequest,
        attempt: Attempt,
        served: str | None,
        started: float,
        decision: Decision,
        config: ProxyConfig,
    ) -> Watch:
        """The mid-stream rate test for this arm (SPEC B5), against the request's frontier."""
        now = self.now()
        plan = self.chooser.plan(
            chat.role, plan_candidates(chat.role, config), self.breakers.exclusion, now
        )
        machine = served or attempt.single_machine
        key = MachineKey(attempt.provider.name, attempt.model.name, machine) if machine else None
        return Watch(
            chat.role,
            sent_at=started,
            started_at=decision.started_at,
            serving=key,
            belief=self.ledger.belief_of(key, now) if key else None,
            frontier=plan.frontier(),
            streams_to_client=True,
        )

    async def _move(
        self,
        chat: ChatRequest,
        attempt: Attempt,
        end: StreamEnd,
        ctx: RelayContext,
        decision: Decision,
        config: ProxyConfig,
        started: float,
        ttft: float,
    ) -> tuple[StreamEnd, ArmAct, float, float]:
        """A rate act after content reached the client (SPEC B6): the alternative continues
        the delivered text and its continuation is spliced into the same stream. If it
        cannot start, the slow stream is kept (never cut for slowness alone). Returns the
        end, what was done, and the final arm's start and time to first content."""
        act = end.moved
        assert act is not None
        assert act.alternative is not None
        target = act.alternative.key
        slow = end.answer.served.machine
        delivered = end.answer.text
        onward = self._onward(target, config)
        if onward is None:
            self.metrics.acts.labels(chat.role.name, act.reason.value, "kept").inc()
            end = await resume_stream(end)
            end.attempt = attempt
            return end, ArmAct.KEPT, started, ttft
        messages = [*chat.body.get("messages", []), {"role": "assistant", "content": delivered}]
        continuation = replace(chat, body={**chat.body, "messages": messages})
        moved_at = self.now()
        onward_started = moved_at
        try:
            opened = await open_stream(continuation, onward, ctx, chat.role.patience_seconds)
        except UpstreamFailure as failure:
            self._record_failure(failure, onward_started)
            decision.arm(self._failed_arm(failure, onward_started, ArmAct.CONTINUED))
            self.metrics.acts.labels(chat.role.name, act.reason.value, "kept").inc()
            end = await resume_stream(end)
            end.attempt = attempt
            return end, ArmAct.KEPT, started, ttft
        decision.arm(
            Arm(attempt.provider.name, attempt.model.name, slow, ArmResult.MOVED, 200,
                moved_at - started, ttft, ArmAct.CONTINUED,
                f"moved ({act.reason.value}) after {act.tokens} tokens: {act.detail}")
        )  # fmt: skip
        self.metrics.acts.labels(chat.role.name, act.reason.value, "continued").inc()
        end = await continue_stream(end, opened)
        onward_ttft = opened.first_at - onward_started
        self._teach(onward, opened.served.machine, ttft=onward_ttft, gaps=end.gaps)
        end.attempt = onward
        return end, ArmAct.CONTINUED, onward_started, onward_ttft

    def _teach(
        self,
        attempt: Attempt,
        machine: str | None,
        *,
        ttft: float | None = None,
        waited: float | None = None,
        gaps: GapStats | None = None,
        cut: bool = False,
    ) -> None:
        """File one arm's sighting in the ledger (SPEC B7): winner, cut or abandoned."""
        name = machine or attempt.single_machine
        if name is None:
            return
        self.ledger.note(
            Sighting(
                attempt.provider.name,
                attempt.model.name,
                name,
                at=self.now(),
                ttft=ttft,
                waited=waited if ttft is None else None,
                gaps=gaps or GapStats(),
                cut=cut,
            )
        )

    def _judge(self, chat: ChatRequest, answer: Answer, attempt: Attempt) -> Verdict:
        return judge(
            answer.text,
            finish_reason=answer.finish_reason,
            has_tool_calls=answer.has_tool_calls,
            status=200,
            prompt=chat.prompt,
            client_capped=chat.client_capped(answer.finish_reason),
        )

    def _record_answer(
        self, attempt: Attempt, answer: Answer, verdict: Verdict, started: float
    ) -> None:
        machine = _machine(attempt, answer)
        self.metrics.observe_verdict(attempt.provider.name, attempt.model.name, verdict)
        if verdict.kind is not VerdictKind.OK:
            self.verdicts.append(
                VerdictRow.of(
                    verdict,
                    provider=attempt.provider.name,
                    model=attempt.model.name,
                    machine=answer.served.machine,
                    at=time.time(),
                )
            )
        self._record(
            Attempted.answered(
                attempt.provider.name,
                attempt.model.name,
                verdict,
                machine=machine,
                started_at=started,
            )
        )

    def _failed_arm(
        self, failure: UpstreamFailure, started: float, act: ArmAct | None = None
    ) -> Arm:
        attempt = failure.attempt
        return Arm(
            attempt.provider.name,
            attempt.model.name,
            failure.machine or attempt.single_machine,
            failure_result(failure),
            failure.status,
            self.now() - started,
            None,
            act,
            failure.detail,
        )

    def _record_failure(self, failure: UpstreamFailure, started: float) -> None:
        attempt = failure.attempt
        provider, model = attempt.provider.name, attempt.model.name
        machine = failure.machine if attempt.is_aggregator else None
        if failure.verdict is not None:
            self.metrics.observe_verdict(provider, model, failure.verdict)
            self.verdicts.append(
                VerdictRow.of(
                    failure.verdict, provider=provider, model=model, machine=failure.machine,
                    at=time.time(),
                )
            )  # fmt: skip
            outcome = Attempted.answered(
                provider, model, failure.verdict, machine=machine, started_at=started
            )
        elif failure.status is not None and failure.transport is None:
            outcome = Attempted.http_error(
                provider,
                model,
                failure.status,
                machine=machine,
                retry_after=parse_retry_after(failure.retry_after, wall_now=time.time()),
                started_at=started,
            )
        else:
            outcome = Attempted.transport_failure(
                provider,
                model,
                failure.transport or TransportFault.CONNECTION_FAILED,
                machine=machine,
                status=failure.status,
                started_at=started,
            )
        self._record(outcome)

    def _record(self, outcome: Attempted) -> None:
        for transition in self.breakers.record(outcome, self.now()):
            self.on_transition(transition)

    def on_transition(self, transition: Transition) -> None:
        log.warning(
            "breaker %s key=%r cause=%s reason=%s trigger=%s",
            transition.kind.value,
            transition.key.describe(),
            transition.cause.value,
            transition.reason.value,
            transition.trigger.value if transition.trigger else "-",
        )
        self.metrics.on_transition(transition)
        self.metrics.observe_breakers(self.breakers.snapshot(self.now()))
        for listener in self.listeners:
            listener(transition)

    def _served(
        self,
        decision: Decision,
        chat: ChatRequest,
        attempt: Attempt,
        answer: Answer,
        verdict: Verdict | None,
        started: float,
        *,
        ttft: float | None = None,
        act: ArmAct | None = None,
        broke: str | None = None,
    ) -> None:
        """Note the arm that reached the client and what the request got from it."""
        provider, model = attempt.provider.name, attempt.model.name
        machine = answer.served.machine or attempt.single_machine
        seconds = self.now() - started
        result, detail = _served_result(chat, answer, seconds, broke)
        decision.arm(Arm(provider, model, machine, result, 200, seconds, ttft, act, detail))
        if machine is not None and broke is None:
            # Affinity (SPEC B3): the machine that answered leads the role's next order.
            self.chooser.answered(decision.role, MachineKey(provider, model, machine))
        decision.served_provider = provider
        # The configured model name: bounded label values, and the key scores are kept by.
        decision.served_model = model
        decision.served_machine = answer.served.machine
        decision.finish_reason = answer.finish_reason
        decision.verdict = verdict.kind.value if verdict is not None else None
        decision.tokens_in = answer.prompt_tokens
        decision.tokens_out = answer.completion_tokens
        if answer.completion_tokens is None and chat.stream:
            decision.tokens_out = answer.content_deltas
            decision.tokens_estimated = True
        decision.cost_usd = _cost(attempt, machine, decision.tokens_in, decision.tokens_out)

    async def _backoff(self, failures: int, deadline: float) -> None:
        """Jittered exponential pause between attempts: no upstream is hammered."""
        delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (failures - 1))
        delay *= 0.5 + self.rng.random() / 2
        delay = min(delay, max(0.0, deadline - self.now()))
        if delay > 0:
            await asyncio.sleep(delay)

    def _rejected(self, failure: UpstreamFailure) -> ProxyError:
        status = failure.status or 400
        return ProxyError(
            status,
            f"Provider {failure.attempt.provider.name!r} rejected the request for model "
            f"{failure.attempt.model.name!r}: {failure.detail}",
            error_type="invalid_request_error",
            code=(
                "content_filter"
                if failure.request_fault is RequestFault.CONTENT_FILTER
                else "upstream_rejected"
            ),
        )

    def _exhausted(
        self,
        chat: ChatRequest,
        candidates: list[Candidate],
        failures: list[UpstreamFailure],
        decision: Decision,
    ) -> ProxyError:
        role = chat.role.name
        decision.outcome = OutcomeKind.FAILED
        if not candidates:
            return ProxyError(
                503,
                f"Role {role!r} has no accepted provider serving any of its models "
                f"({', '.join(chat.role.models)}); add or fix a ProviderPolicy that serves one.",
                error_type="service_unavailable",
                code="no_provider",
            )
        skipped = decision.skipped_reasons()
        tried = "; ".join(f.describe() for f in failures) or "nothing was sent"
        why = f" Skipped: {'; '.join(skipped)}." if skipped else ""
        if failures and all(f.status == 429 for f in failures):
            waits = [
                w for f in failures if (w := parse_retry_after(f.retry_after, wall_now=time.time()))
            ]
            return ProxyError(
                429,
                f"Every upstream for role {role!r} is rate limited: {tried}.{why} "
                "Retry after the time in the Retry-After header.",
                error_type="rate_limit_error",
                code="upstream_rate_limited",
                headers={"Retry-After": str(max(1, math.ceil(min(waits))))} if waits else None,
            )
        if failures and all(f.request_fault is RequestFault.CONTEXT_LENGTH for f in failures):
            return ProxyError(
                400,
                f"The request is too long for every model of role {role!r}: {tried}. "
                "Shorten it, or add a model with a larger context to the role.",
                code="context_length_exceeded",
            )
        return ProxyError(
            502 if failures else 503,
            f"No upstream could serve role {role!r}: {tried}.{why} Check that each "
            "ProviderPolicy endpoint is reachable and its API key is set; tripped "
            "breakers reopen by themselves after their cooldown.",
            error_type="upstream_error",
            code="upstream_unavailable" if failures else "all_candidates_excluded",
        )


def failure_result(failure: UpstreamFailure) -> ArmResult:
    """What an attempt that produced nothing usable says about its machine (SPEC C1)."""
    if failure.verdict is not None:
        # Empty on 200 is a hot-path observation; a mangled encoding is the breaker's.
        if failure.verdict.kind is VerdictKind.MALFORMED:
            return ArmResult.EMPTY_SUCCESS
        return ArmResult.DEGRADED
    if failure.request_fault is not None:
        return ArmResult.REQUEST_FAULT
    if failure.status is not None and failure.transport is None:
        if failure.status == 429:
            return ArmResult.RATE_LIMITED
        if failure.status in (401, 402, 403):
            return ArmResult.UNAUTHORIZED
        return ArmResult.SERVER_ERROR
    if failure.unparsable:
        return ArmResult.PARSE_FAILURE
    return _TRANSPORT_RESULTS[failure.transport or TransportFault.CONNECTION_FAILED]


_TRANSPORT_RESULTS = {
    TransportFault.CONNECTION_FAILED: ArmResult.REFUSED,
    TransportFault.TIMEOUT: ArmResult.TIMEOUT,
    TransportFault.BROKEN_STREAM: ArmResult.BROKEN_STREAM,
    TransportFault.STREAM_ERROR: ArmResult.SERVER_ERROR,
}


def _served_result(
    chat: ChatRequest, answer: Answer, seconds: float, broke: str | None
) -> tuple[ArmResult, str]:
    """The served arm's result: broken after content, length-capped by the upstream (not
    by the caller's own max_tokens), late past the role's patience, or ok. A verdict that
    did not steer (it let the answer through) is on the outcome record, not in this."""
    if broke is not None:
        return ArmResult.BROKEN_STREAM, broke
    if answer.finish_reason == "length" and not chat.client_capped(answer.finish_reason):
        return ArmResult.LENGTH_CAPPED, "answered, cut at the upstream's output limit"
    patience = chat.role.patience_seconds
    if seconds > patience:
        return ArmResult.LATE, f"answered in {seconds:.1f} s, past the patience of {patience:g} s"
    return ArmResult.OK, "answered"


def _cost(
    attempt: Attempt, machine: str | None, tokens_in: int | None, tokens_out: int | None
) -> float | None:
    """USD from the machine's published prices; None when a price or a count is missing."""
    sheet = next((m for m in attempt.model.machines if m.name == machine), None)
    if sheet is None or tokens_in is None or tokens_out is None:
        return None
    if sheet.price_input_per_mtok is None or sheet.price_output_per_mtok is None:
        return None
    return (tokens_in * sheet.price_input_per_mtok + tokens_out * sheet.price_output_per_mtok) / 1e6


def _machine(attempt: Attempt, answer: Answer) -> str | None:
    """The machine key for the breaker: an aggregator's sub-provider, None for a direct one."""
    return answer.served.machine if attempt.is_aggregator else None


def _presumed_machine(attempt: Attempt) -> str | None:
    """The machine expected to serve before the answer names one: a direct provider's, or
    the head of an aggregator's order (or `only`)."""
    if attempt.single_machine is not None:
        return attempt.single_machine
    routing = attempt.provider_routing or {}
    names = routing.get("order") or routing.get("only") or []
    return str(names[0]) if names else None


async def _settle(task: asyncio.Task[OpenStream]) -> asyncio.Task[OpenStream]:
    """Wait for the task to finish (its exception stays in it)."""
    await asyncio.wait({task})
    return task
