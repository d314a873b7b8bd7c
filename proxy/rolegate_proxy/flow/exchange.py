"""One client request, from its role to its answer: the `Exchange`.

The request's candidates (a model of the role on a provider serving it) are tried in the
chooser's order. For each, the chooser says which machines may be sent to; the breakers
admit the attempt the moment it is sent (a half-open key lets exactly one attempt through:
this exchange holds that probe until its arm ends, and gives back whatever it still holds
when the request ends, however it ends). An arm that fails before anything reached the
client moves on, invisibly: to another machine of the same model (the failing one avoided),
then to the next candidate, with a short jittered backoff and never past the role's
patience. A 400 is never resent unchanged to the same model: context length moves on to a
later model, any other refusal of the request goes back to the caller. A pooled connection
the upstream had closed is sent again at once on a fresh one, counting against nothing.
One memory per request (`memory.py`, SPEC B9): every arm's end is noted in it, and every
choice made here or by the request's streamed arms (`onward`) skips what it remembers.
Every arm's end goes to the recorder; every candidate skipped is on the decision with why.
Streamed arms are served by `serving.StreamServer`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, TypeVar

from aiohttp import web

from rolegate_policy.config import ProxyConfig
from rolegate_policy.enums import Delivery, Ruling

from ..core.arm_end import Answered, ArmEnd, Cause, RequestFault
from ..core.beliefs import MachineKey
from ..core.decisions import Decision
from ..core.outcomes import ArmAct
from ..core.routing import Attempt, Candidate, MachineRouting, routes_machines
from ..wire.chat_request import ChatRequest
from ..wire.errors import ProxyError
from .arms import ArmRun, Reply, complete, reply_response, verdict_on
from .client_stream import ClientStream
from .failures import exhausted, refused_for_patience, rejected
from .gate import Gate
from .memory import TRANSIENT, RequestMemory
from .services import Services, served_headers
from .serving import StreamServer
from .upstream import ArmFailed, Silence, StaleConnection

T = TypeVar("T")
log = logging.getLogger("rolegate.proxy")

# Waiting out a Retry-After, this much longer than it says.
RETRY_AFTER_MARGIN: Final = 0.02
# The share of a role's patience one silent attempt may use while others could answer.
IDLE_SHARE = 0.5


@dataclass(slots=True)
class Exchange:
    services: Services
    request: web.Request
    chat: ChatRequest
    config: ProxyConfig
    decision: Decision
    headers: dict[str, str]
    # Every arm that produced nothing usable, in order.
    failures: list[ArmEnd] = field(default_factory=list)
    # What this request saw of its machines and models: never chosen again (SPEC B9).
    memory: RequestMemory = field(default_factory=RequestMemory)
    # The chooser's and the breakers' word on each attempt, and the probes it holds.
    gate: Gate = field(init=False)
    # Attempts made, in all and per model on a provider (SPEC E5: the role's retry settings).
    attempts: int = 0
    per_model: dict[tuple[str, str], int] = field(default_factory=dict)
    client: ClientStream | None = None
    # Every arm made for the request (each counted on its machine: `counted`).
    runs: list[ArmRun] = field(default_factory=list)
    # How many failures there were at the last backoff: one pause per failure, however
    # the retry loops meet (a candidate's last try, then the next candidate).
    paused_after: int = 0

    def __post_init__(self) -> None:
        self.gate = Gate(self.services, self.chat, self.decision)

    def client_stream(self) -> ClientStream:
        """The client's stream, made when the first streamed arm commits to it (a buffered
        one when the request begins: its keep-alives run from then)."""
        if self.client is None:
            self.client = ClientStream(
                self.request, self.headers, self.chat, self.services.now,
                buffered=self.chat.role.delivery is Delivery.BUFFERED,
                keepalive_seconds=self.services.keepalive_seconds,
            )  # fmt: skip
        return self.client

    @property
    def deadline(self) -> float:
        return self.decision.started_at + self.chat.role.patience_seconds

    async def run(self) -> web.StreamResponse:
        if self.chat.stream and self.chat.role.delivery is Delivery.BUFFERED:
            # Held from the start: the caller hears from us while its answer is made.
            self.client_stream().keep_alive()
        try:
            return await self._serve()
        except ProxyError as error:
            client = self.client
            if client is None or client.response is None:
                raise
            # Keep-alives committed the stream (200) while nothing was shown: the error
            # travels as an event.
            self.decision.error_code = error.code
            await client.refuse(error)
            return client.response
        finally:
            if self.client is not None:
                self.client.close()
            # A probe whose arm ended without a conclusive answer (cancelled, crashed, the
            # client gone) is given back, so the next request can probe.
            for admission in self.gate.probes:
                self.services.breakers.release(admission)
            self._give_back_places()

    async def _serve(self) -> web.StreamResponse:
        now = self.services.now()
        candidates = self.services.chooser.order_candidates(
            self.chat.role, self.services.candidates(self.chat.role, self.config),
            self.services.breakers.exclusion, now, prompt_tokens=self.chat.prompt_tokens,
        )  # fmt: skip
        if not candidates:
            raise exhausted(self.chat, [], self.failures, self.decision)
        for index, candidate in enumerate(candidates):
            if self._body_refused(candidate.provider.name, candidate.model.name):
                continue
            last = index + 1 == len(candidates)
            response = await self._candidate(candidate, last)
            if response is not None:
                self._note_refused(candidates[index + 1 :])
                return response
            if self._out_of_time():
                for later in candidates[index + 1 :]:
                    self.decision.skip(
                        later.provider.name, later.model.name, None, self._stop_reason()
                    )
                break
            if index + 1 < len(candidates) and self.failures:
                await self._backoff()
        if not self.failures:
            response = await self._last_resort(candidates)
            if response is not None:
                return response
        raise exhausted(self.chat, candidates, self.failures, self.decision)

    async def _candidate(self, candidate: Candidate, last: bool) -> web.StreamResponse | None:
        """Attempts at one candidate while its model has attempts left (SPEC E5): again
        after a transient failure (on an aggregator, avoiding the machine that failed), after
        a 429's Retry-After when it fits the patience; a 400 is never resent unchanged.
        Every machine the request remembers is avoided, except the one a retry goes back
        to after a transient fault (SPEC B9)."""
        model = candidate.model.name
        key = (candidate.provider.name, model)
        retrying: MachineKey | None = None
        while True:
            if self._out_of_time() or self._model_spent(key):
                why = self._stop_reason() if self._out_of_time() else "attempts per model spent"
                self.decision.skip(candidate.provider.name, model, None, why)
                return None
            avoid = self.memory.avoided(candidate.provider.name, model, retrying=retrying)
            attempt = self.gate.choose(candidate, avoid)
            if attempt is None:
                return None
            self.attempts += 1
            self.per_model[key] = self.per_model.get(key, 0) + 1
            response = await self._try(attempt, self._budget(last and self._final(attempt)))
            if response is not None:
                return response
            failure = self.failures[-1]
            fault = _request_fault(failure)
            if fault is RequestFault.CONTEXT_LENGTH:
                return None  # remembered: no candidate of this model is sent it again
            if fault is not None:
                # About the request, not the machine: the caller gets it back.
                raise rejected(failure, fault)
            again = await self._again(candidate, failure)
            if again is None:
                return None
            retrying = again.back_to

    async def _again(self, candidate: Candidate, failure: ArmEnd) -> Retry | None:
        """Whether the same candidate is tried again, after the pause that calls for (None:
        it is not), and whether that retry may go back to the machine that failed."""
        if self._model_spent((candidate.provider.name, candidate.model.name)):
            return None
        if self._out_of_time():
            return None
        failed = _key_of(failure)
        wait = failure.retry_after
        if failure.status == 429 and not self._others(candidate):
            # Nothing else serves this model here: its Retry-After is honoured, when the
            # wait fits what is left of the patience.
            if wait is None or self.services.now() + wait >= self.deadline:
                return None
            # (A hair past it: the breaker's exclusion for the 429 ends exactly then.)
            await asyncio.sleep(wait + RETRY_AFTER_MARGIN)
            self.paused_after = len(self.failures)
            return Retry(back_to=failed)
        if candidate.is_aggregator and failure.machine:
            await self._backoff()
            return Retry(back_to=None)  # another machine of the same model
        if failure.cause not in TRANSIENT:
            return None  # nothing narrower to avoid: the next candidate
        await self._backoff()
        return Retry(back_to=failed)  # a direct provider's one machine, after a blip

    def _others(self, candidate: Candidate) -> bool:
        """An aggregator candidate has machines on its sheet this request has not left."""
        if not candidate.is_aggregator:
            return False
        provider, model = candidate.provider.name, candidate.model.name
        left = {key.machine for key in self.memory.avoided(provider, model)}
        return bool(set(candidate.machine_names()) - left)

    def _final(self, attempt: Attempt) -> bool:
        """No other attempt at this candidate could follow this one if it goes silent: its
        attempts are spent, or it has no other machine to turn to (a direct provider is
        not asked again after a timeout)."""
        key = (attempt.provider.name, attempt.model.name)
        routing = attempt.routing
        return self._model_spent(key) or routing is None or len(routing.machines) < 2

    def _budget(self, final: bool) -> float:
        """How long this arm may stay silent: all that is left of the patience for the
        request's final attempt (SPEC E5), else at most IDLE_SHARE of the patience."""
        remaining = self.deadline - self.services.now()
        if final:
            return remaining
        return min(remaining, self.chat.role.patience_seconds * IDLE_SHARE)

    def _model_spent(self, key: tuple[str, str]) -> bool:
        """The attempts at a model on a provider are spent (the role's attemptsPerModel)."""
        return self.per_model.get(key, 0) >= self.chat.role.retry.attempts_per_model

    def _note_refused(self, untried: list[Candidate]) -> None:
        """The candidates an earlier one's answer made unnecessary: those a breaker refuses
        are on the decision all the same, with why (the chooser orders them last, so they
        are the ones a reader looks for)."""
        exclusion, now = self.services.breakers.exclusion, self.services.now()
        for candidate in untried:
            provider, model = candidate.provider.name, candidate.model.name
            refused = exclusion(provider, model, None, now)
            if refused is not None:
                self.decision.skip(provider, model, None, refused.describe())

    def _body_refused(self, provider: str, model: str, *, continuation: bool = False) -> bool:
        """The model refused this request's body as a request fault: it is not sent it again
        (on the decision, with why)."""
        fault = self.memory.body_refused(model, continuation=continuation)
        if fault is None:
            return False
        why = (
            "the model's context is too small"
            if fault is RequestFault.CONTEXT_LENGTH
            else f"the model refused this request ({fault.value})"
        )
        self.decision.skip(provider, model, None, why)
        return True

    def _out_of_time(self) -> bool:
        return (
            self.deadline - self.services.now() <= 0
            or self.attempts >= self.chat.role.retry.max_attempts
        )

    def _stop_reason(self) -> str:
        if self.deadline - self.services.now() <= 0:
            return "the role's patience ran out"
        return "attempt limit"

    # -- admission --------------------------------------------------------------------

    def onward(
        self,
        provider_name: str,
        model_name: str,
        machine: str,
        *,
        continuation: bool = False,
        retry: bool = False,
    ) -> Attempt | None:
        """An attempt aimed at exactly one machine (a race's rival, a move, a rescue),
        admitted by the breakers like any other; never one this request remembers, nor a
        model that refused the body it would be sent (`continuation`: the request plus
        the text delivered, a different body). `retry`: the machine may be one whose only
        mark is a transient fault (SPEC B9's exception)."""
        provider = self.config.provider(provider_name)
        model = provider.model(model_name) if provider is not None else None
        if provider is None or model is None:
            return None
        key = MachineKey(provider_name, model_name, machine)
        why = self.memory.why(key, continuation=continuation)
        if why is not None and not (retry and self.memory.retriable(key)):
            self.decision.skip(provider_name, model_name, machine, why.value)
            return None
        if self._body_refused(provider_name, model_name, continuation=continuation):
            return None
        routing = MachineRouting.only(machine) if routes_machines(provider) else None
        return self.gate.admitted(Attempt(provider, model, routing))

    # -- one arm ----------------------------------------------------------------------

    def _try(
        self, attempt: Attempt, budget: float
    ) -> Coroutine[Any, Any, web.StreamResponse | None]:
        """The arm, streamed or not, for the caller to await (returned, not awaited here: a
        coroutine less for every step of the arm to pass through)."""
        if self.chat.stream:
            return StreamServer(self, attempt, budget).serve()
        return self._complete(attempt, budget)

    async def _complete(self, attempt: Attempt, budget: float) -> web.StreamResponse | None:
        silence = Silence.for_arm(attempt, budget, stream=False)
        run = self.counted(ArmRun(attempt, self.services.now(), False, silence))
        upstreams = self.services.upstreams
        try:
            reply = await self.send_fresh_once(
                run, lambda fresh: complete(upstreams, run, self.chat, fresh=fresh)
            )
        except ArmFailed as failure:
            self.fail(run.failed(failure, self.services.now()))
            return None
        except asyncio.CancelledError:
            # The client left (or we shut down) while the upstream worked: the wait still
            # teaches (B7).
            self.record(self.services.cancelled(run, "before the answer"))
            raise
        return self._answered(run, reply)

    def _answered(self, run: ArmRun, reply: Reply) -> web.StreamResponse | None:
        got = reply.completion
        verdict = verdict_on(
            self.chat, got.text, got.finish_reason, tool_calls=got.tool_calls, refusal=got.refusal
        )
        answer = Answered(
            got.finish_reason, got.prompt_tokens, got.completion_tokens,
            capped_by_upstream=self._capped(got.finish_reason),
        )  # fmt: skip
        now = self.services.now()
        if verdict.counts(run.attempt.provider.degraded_output):
            detail = f"answered 200 but the answer is {verdict.kind.value}"
            self.fail(run.end(Cause.DEGRADED, now, detail, verdict=verdict, answer=answer))
            return None
        end = run.end(Cause.ANSWERED, now, "answered", verdict=verdict, answer=answer)
        self.served(end)
        headers = {**self.headers, **served_headers(run, got.model)}
        return reply_response(reply, headers)

    async def send_fresh_once(self, run: ArmRun, send: Callable[[bool], Awaitable[T]]) -> T:
        """`send`, and once more on a fresh connection if the pooled one was stale (that
        attempt is recorded, charged to nobody, and counts against no limit)."""
        try:
            return await send(False)
        except StaleConnection as stale:
            self.record(run.failed(stale, self.services.now()))
            run.started = self.services.now()
            return await send(True)

    # -- bookkeeping ------------------------------------------------------------------

    def counted(self, run: ArmRun) -> ArmRun:
        """`run` counts as in flight on its machine from now (SPEC B8) until its end; the
        request keeps it, so that however the request ends, nothing stays counted."""
        self.runs.append(run.count_on(self.services.upstreams.load))
        return run

    def _give_back_places(self) -> None:
        """Every arm of the request has ended by now, each giving back its place in its
        machine's queue. One that did not (an end never made: a bug, named in the log)
        gives it back here, rather than make its machine look busy for half an hour."""
        for run in self.runs:
            ticket = run.ticket
            if ticket is not None and not ticket.returned:
                ticket.owner.give_back(ticket, None)
                log.warning(
                    "an arm of request %s on %s ended without its end recorded: its place "
                    "in the machine's queue is given back",
                    self.decision.request_id, run.machine or "an unnamed machine",
                )  # fmt: skip

    def record(self, end: ArmEnd, *, continuation: bool = False) -> None:
        """An arm's end, recorded and remembered (`continuation`: it was sent the request
        plus the text delivered, not the request's own body)."""
        self.memory.note(end, continuation=continuation)
        self.services.recorder.record(end, self.decision, self.chat.role.patience_seconds)

    def fail(self, end: ArmEnd, *, continuation: bool = False) -> None:
        self.record(end, continuation=continuation)
        self.failures.append(end)

    def served(self, end: ArmEnd, *, recorded: bool = False) -> None:
        """The arm whose answer reached the client: recorded (unless it was), and the
        request's outcome."""
        self.services.recorder.served(
            end, self.decision, self.chat.role.patience_seconds, self.config, recorded=recorded
        )

    def _capped(self, finish_reason: str | None) -> bool:
        return finish_reason == "length" and not self.chat.client_capped(finish_reason)

    async def _backoff(self) -> None:
        """Jittered exponential pause between attempts: no upstream is hammered."""
        if self.paused_after == len(self.failures):
            return
        self.paused_after = len(self.failures)
        retry = self.chat.role.retry
        first, cap = retry.backoff_seconds, retry.max_backoff_seconds
        delay = min(cap, first * 2 ** (max(len(self.failures), 1) - 1))
        delay *= 0.5 + self.services.draw() / 2
        delay = min(delay, max(0.0, self.deadline - self.services.now()))
        if delay > 0:
            await asyncio.sleep(delay)

    async def _last_resort(self, candidates: list[Candidate]) -> web.StreamResponse | None:
        """B4: nothing was sendable. An empty admitted set falls back to an `order` of the
        machines refused only for patience (a slow answer beats none); machines under a
        hard exclusion are never sent to."""
        services = self.services
        candidates = [c for c in candidates if self.memory.body_refused(c.model.name) is None]
        plan = services.chooser.plan(
            self.chat.role, candidates, services.breakers.exclusion, services.now(),
            avoid=self.memory.all_avoided(),
        )  # fmt: skip
        if self.chat.role.effective_ruling is Ruling.ONLY:
            # `Only` demands the admitted set: a pool too slow is a refusal, at once (B4).
            error = refused_for_patience(self.chat, plan, self.decision)
            if error is not None:
                raise error
            return None
        resort = plan.last_resort()
        if resort is None or self.deadline <= services.now():
            return None
        for candidate in candidates:
            if (candidate.provider.name, candidate.model.name) == (resort.provider, resort.model):
                attempt = self.gate.admitted(
                    Attempt(candidate.provider, candidate.model, resort.routing)
                )
                if attempt is None:
                    return None
                return await self._try(attempt, self.deadline - services.now())
        return None


class Retry(NamedTuple):
    """Another attempt at the same candidate; `back_to`: the machine that failed, which
    it may go back to (its fault was transient and nothing narrower is left, SPEC B9)."""

    back_to: MachineKey | None


def _key_of(end: ArmEnd) -> MachineKey | None:
    return None if end.machine is None else MachineKey(end.provider, end.model, end.machine)


def _request_fault(end: ArmEnd) -> RequestFault | None:
    """How the upstream refused the caller's request (None: it did not). A continuation
    refused (a machine that will not take a prefilled assistant message) refused our body,
    not the caller's: the request goes on elsewhere."""
    if end.cause is not Cause.REJECTED or end.act is ArmAct.CONTINUED:
        return None
    return end.request_fault
