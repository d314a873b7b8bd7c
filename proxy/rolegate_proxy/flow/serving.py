"""Serving one streamed arm: its first content (raced against a better machine when it is
late), the client's stream, the relay, and moving a stream far slower than the best
alternative (SPEC B5, B6, E4).

Before any content reached the client a late first token is a race: a rival starts on the
better machine, whichever produces content first is kept, the other is cancelled, and both
teach the ledger. After content reached the client, a rate act moves the stream only to a
machine that continues a partial assistant message: it is sent the request plus the text
already delivered, and its continuation is spliced into the same client stream. Otherwise
the slow stream is kept (never cut for slowness alone) and the act is counted as kept.
The client leaving ends the serving arm as the client's doing, never the upstream's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from aiohttp import web

from rolegate_policy.config import ProxyConfig

from ..core.arm_end import Answered, ArmEnd, Cause
from ..core.beliefs import MachineKey
from ..core.decisions import Decision
from ..core.outcomes import ArmAct, OutcomeKind
from ..core.routing import Attempt
from ..core.watch import Act, Watch
from ..wire.chat_request import ChatRequest
from .arms import ArmRun, StreamHooks, open_stream, verdict_on
from .client_stream import ClientGone, ClientStream
from .services import Services, served_headers
from .stream import OpenedStream, Relay, Stop, StopKind
from .upstream import ArmFailed, Silence

T = TypeVar("T")


class Host(Protocol):
    """What a streamed arm needs of its exchange."""

    @property
    def services(self) -> Services: ...

    @property
    def chat(self) -> ChatRequest: ...

    @property
    def config(self) -> ProxyConfig: ...

    @property
    def decision(self) -> Decision: ...

    def client_stream(self) -> ClientStream: ...

    def onward(self, provider: str, model: str, machine: str) -> Attempt | None: ...

    def record(self, end: ArmEnd) -> None: ...

    def fail(self, end: ArmEnd) -> None: ...

    def served(self, end: ArmEnd) -> None: ...

    async def send_fresh_once(self, run: ArmRun, send: Callable[[bool], Awaitable[T]]) -> T: ...


@dataclass(slots=True)
class _Leg:
    """The arm serving the client now, and its stream."""

    run: ArmRun
    opened: OpenedStream | None = None
    # Its end is recorded (a stream that broke after content): the client leaving while
    # it is told so ends nothing more.
    recorded: bool = False


class StreamServer:
    def __init__(self, host: Host, attempt: Attempt, budget: float) -> None:
        self.host = host
        self.services = host.services
        self.now = host.services.now
        self.attempt = attempt
        self.budget = budget
        self.leg = _Leg(self._run(attempt, budget))
        # The arms waiting for their first content: the client leaving ends each of them.
        self.waiting: list[ArmRun] = [self.leg.run]

    async def serve(self) -> web.StreamResponse | None:
        """The client's response once this arm's content reached it; None when it failed
        before that (recorded; the exchange moves on)."""
        if not await self._first_content():
            return None
        opened = self.leg.opened
        assert opened is not None
        if opened.empty and self._refused_empty(opened):
            return None
        client = self.host.client_stream()
        try:
            await client.start(served_headers(self.leg.run, opened.model))
            self.host.decision.first_content_at = self.now()
            return await self._relay(client)
        except ClientGone:
            self._left(self.leg.run.end(Cause.CLIENT_LEFT, self.now(),
                                        "the client went away mid-stream"))  # fmt: skip
            self.host.decision.outcome = OutcomeKind.CANCELLED
            return client.response
        except asyncio.CancelledError:
            self._left(self.services.cancelled(self.leg.run, "mid-stream"))
            raise

    # -- arms ---------------------------------------------------------------------------

    def _run(
        self, attempt: Attempt, budget: float, act: ArmAct | None = None, delivered: int = 0
    ) -> ArmRun:
        now = self.now()
        run = ArmRun(attempt, now, True, Silence.for_arm(attempt, budget, stream=True), act)
        run.watch = self._watch(run, delivered)
        return run

    def _watch(self, run: ArmRun, delivered: int) -> Watch:
        """The mid-stream rate test for this arm (SPEC B5), against the request's frontier."""
        services, chat = self.services, self.host.chat
        now = self.now()
        candidates = services.candidates(chat.role, self.host.config)
        plan = services.chooser.plan(chat.role, candidates, services.breakers.exclusion, now)
        key = self._key(run)
        return Watch(
            chat.role,
            sent_at=run.started,
            started_at=self.host.decision.started_at,
            serving=key,
            belief=None if key is None else services.recorder.ledger.belief_of(key, now),
            frontier=plan.frontier(),
            streams_to_client=True,
            delivered=delivered,
        )

    def _key(self, run: ArmRun) -> MachineKey | None:
        machine = run.machine
        attempt = run.attempt
        return (
            None
            if machine is None
            else MachineKey(attempt.provider.name, attempt.model.name, machine)
        )

    async def _open(self, run: ArmRun, chat: ChatRequest) -> OpenedStream:
        metrics = self.services.recorder.metrics
        provider = run.attempt.provider.name

        def named(machine: str) -> None:
            run.named = machine
            key = self._key(run)
            if run.watch is not None and key is not None and key != run.watch.serving:
                run.watch.identify(key, self.services.recorder.ledger.belief_of(key, self.now()))

        hooks = StreamHooks(
            clock=self.now,
            named=named,
            malformed=metrics.malformed_events.labels(provider).inc,
            missing_charset=metrics.missing_charset.labels(provider).inc,
        )
        opened = await self.host.send_fresh_once(
            run,
            lambda fresh: open_stream(
                self.services.upstreams, run, chat, replace(hooks, fresh=fresh)
            ),
        )
        if run.watch is not None and not opened.empty:
            run.watch.observe(opened.first_at, tokens=1)
        return opened

    # -- the first content, raced when it is late ---------------------------------------

    async def _first_content(self) -> bool:
        run = self.leg.run
        first = asyncio.create_task(self._open(run, self.host.chat))
        try:
            act = await self._late(first, run)
            if act is None:
                return self._settled(first, run)
            rival = self._rival(act)
            if rival is None:
                await asyncio.wait({first})
                return self._settled(first, run)
            return await self._race(first, rival, act)
        except asyncio.CancelledError:
            first.cancel()
            # The client left (or we shut down) before the first token: each wait still
            # teaches (B7).
            for waiting in self.waiting:
                self.host.record(self.services.cancelled(waiting, "before the first token"))
            raise
        finally:
            self.waiting.clear()

    async def _late(self, first: asyncio.Task[OpenedStream], run: ArmRun) -> Act | None:
        """Wait for the arm's first content; the rate test's act if it calls the first
        token late while a better machine could race it, else None once the arm settled."""
        watch = run.watch
        assert watch is not None
        while True:
            check_at = watch.next_check(self.now())
            timeout = None if check_at is None else max(0.0, check_at - self.now())
            done, _ = await asyncio.wait({first}, timeout=timeout)
            if done:
                return None
            act = watch.observe(self.now())
            if act is not None and act.movable and act.alternative is not None:
                return act

    def _rival(self, act: Act) -> ArmRun | None:
        assert act.alternative is not None
        target = act.alternative.key
        attempt = self.host.onward(target.provider, target.model, target.machine)
        if attempt is None:
            return None
        self.services.recorder.act(self.host.chat.role.name, act, "raced")
        self.leg.run.act = ArmAct.RACED
        rival = self._run(attempt, self.budget, ArmAct.RACED)
        self.waiting.append(rival)
        return rival

    def _settled(self, task: asyncio.Task[OpenedStream], run: ArmRun) -> bool:
        try:
            self.leg = _Leg(run, task.result())
        except ArmFailed as failure:
            self.host.fail(run.failed(failure, self.now()))
            return False
        return True

    async def _race(self, first: asyncio.Task[OpenedStream], rival: ArmRun, act: Act) -> bool:
        """Both arms run; the one that produces content first serves, the other is
        cancelled (and teaches what it waited)."""
        second = asyncio.create_task(self._open(rival, self.host.chat))
        arms = {first: self.leg.run, second: rival}
        pending: set[asyncio.Task[OpenedStream]] = set(arms)
        lost: list[ArmEnd] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if self._settled_quietly(task, arms[task], lost):
                        await self._cancel_losers(pending, arms, act)
                        for end in lost:
                            self.host.fail(end)
                        return True
        finally:
            for task in pending:
                task.cancel()
        for end in lost:
            self.host.fail(end)
        return False

    def _settled_quietly(
        self, task: asyncio.Task[OpenedStream], run: ArmRun, lost: list[ArmEnd]
    ) -> bool:
        self.waiting.remove(run)
        try:
            self.leg = _Leg(run, task.result())
        except ArmFailed as failure:
            lost.append(run.failed(failure, self.now()))
            return False
        return True

    async def _cancel_losers(
        self,
        pending: set[asyncio.Task[OpenedStream]],
        arms: dict[asyncio.Task[OpenedStream], ArmRun],
        act: Act,
    ) -> None:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in pending:
            loser = arms[task]
            self.waiting.remove(loser)
            detail = f"lost the race; raced ({act.reason.value}): {act.detail}"
            self.host.record(loser.end(Cause.RACE_LOST, self.now(), detail))
        pending.clear()

    def _refused_empty(self, opened: OpenedStream) -> bool:
        """A stream that finished with nothing in it, before anything reached the client:
        another machine or model may still answer, if the empty answer counts (SPEC A2)."""
        run = self.leg.run
        verdict = verdict_on(self.host.chat, "", opened.finish_reason, False)
        if not verdict.counts(run.attempt.provider.degraded_output):
            return False
        opened.close()
        self.host.fail(run.end(Cause.DEGRADED, self.now(), "answered 200 with an empty completion",
                               verdict=verdict))  # fmt: skip
        return True

    # -- the relay ----------------------------------------------------------------------

    async def _relay(self, client: ClientStream) -> web.StreamResponse:
        opened = self.leg.opened
        assert opened is not None
        assert self.leg.run.watch is not None
        relay = Relay(opened, client, self.leg.run.watch, self.leg.run.silence, self.now)
        while True:
            stop = await relay.run()
            self._kept(relay)
            if stop.kind is StopKind.DONE:
                return self._done(client)
            if stop.kind is StopKind.BROKE:
                return await self._broke(client, stop)
            assert stop.act is not None
            moved = await self._move(client, stop.act)
            if moved is None:
                relay.may_move = False  # kept: the slow stream goes on
            else:
                relay = moved

    def _kept(self, relay: Relay) -> None:
        role = self.host.chat.role.name
        for act in relay.kept:
            self.services.recorder.act(role, act, "kept")
            run = self.leg.run
            run.act = run.act or ArmAct.KEPT
        relay.kept.clear()

    def _answer(self, client: ClientStream) -> Answered:
        delivered = client.delivered
        finish = delivered.finish_reason
        return Answered(
            finish, delivered.prompt_tokens, delivered.completion_tokens, delivered.content_deltas,
            capped_by_upstream=finish == "length" and not self.host.chat.client_capped(finish),
        )  # fmt: skip

    def _done(self, client: ClientStream) -> web.StreamResponse:
        """The client has the complete answer: nothing more is read or awaited."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        delivered = client.delivered
        verdict = verdict_on(self.host.chat, delivered.text, delivered.finish_reason,
                             delivered.has_tool_calls)  # fmt: skip
        end = run.end(Cause.ANSWERED, self.now(), "answered", verdict=verdict,
                      answer=self._answer(client))  # fmt: skip
        self.host.served(end)
        assert client.response is not None
        return client.response

    async def _broke(self, client: ClientStream, stop: Stop) -> web.StreamResponse:
        """Content had reached the client, then the stream broke: the stream counts against
        the machine, the client gets an error event, and the request is over."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        end = run.end(stop.cause, self.now(), f"stream broke after content: {stop.detail}",
                      answer=self._answer(client))  # fmt: skip
        end.delivered = True
        self.host.served(end)
        self.leg.recorded = True
        await client.fail(stop.detail)
        assert client.response is not None
        return client.response

    async def _move(self, client: ClientStream, act: Act) -> Relay | None:
        """A rate act after content reached the client: the alternative continues the
        delivered text in the same stream, or (it cannot start) the slow stream is kept."""
        assert act.alternative is not None
        target = act.alternative.key
        role = self.host.chat.role.name
        attempt = self.host.onward(target.provider, target.model, target.machine)
        if attempt is None:
            self.services.recorder.act(role, act, "kept")
            return None
        delivered = client.delivered
        onward = self._run(attempt, self.host.chat.role.patience_seconds, ArmAct.CONTINUED,
                           delivered.content_deltas)  # fmt: skip
        try:
            opened = await self._open(onward, self.host.chat.continued(delivered.text))
        except ArmFailed as failure:
            self.host.fail(onward.failed(failure, self.now()))
            self.services.recorder.act(role, act, "kept")
            return None
        slow = self.leg
        assert slow.opened is not None
        slow.opened.close()
        slow.run.act = ArmAct.CONTINUED
        detail = f"moved ({act.reason.value}) after {act.tokens} tokens: {act.detail}"
        self.host.record(slow.run.end(Cause.MOVED, self.now(), detail))
        self.services.recorder.act(role, act, "continued")
        self.leg = _Leg(onward, opened)
        assert onward.watch is not None
        return Relay(opened, client, onward.watch, onward.silence, self.now, may_move=False)

    def _left(self, end: ArmEnd) -> None:
        """The client went away (or we shut down) while this leg served it."""
        if self.leg.opened is not None:
            self.leg.opened.close()
        if not self.leg.recorded:
            self.host.record(end)
