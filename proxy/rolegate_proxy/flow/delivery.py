"""Delivering a streamed answer once its first content reached the client (SPEC B5, B6,
E4, E5): the relay, moving a stream far slower than the best alternative, and rescuing one
that broke.

After content reached the client, two things can hand the answer to another machine, and
both splice its continuation into the same client stream: the machine is sent the request
plus the text already delivered as a partial assistant message, and what it writes
follows what the client has, nothing repeated, nothing lost.

* A rate act (the stream fell decisively behind, or went silent) moves it to the act's
  alternative when that one continues partial messages; otherwise the slow stream is kept
  (never cut for slowness alone) and the act counted as kept.
* A break (cut, in-band error, stall) is rescued by the first admissible machine that
  continues partial messages: the same model's first, then the role's other models. A
  machine that refuses the prefill (a 400) is one failed rescue, never the answer while
  another remains. With none, the client gets an error event, never a truncated answer
  presented as complete.

The client leaving ends the serving arm as the client's doing, never the upstream's.
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web

from rolegate_policy.status import ProtocolQuirk

from ..core.arm_end import Answered, ArmEnd, Cause
from ..core.beliefs import MachineKey
from ..core.outcomes import ArmAct, OutcomeKind
from ..core.watch import Act
from .arms import verdict_on
from .client_stream import ClientGone, ClientStream
from .services import served_headers
from .stream import Relay, Stop, StopKind
from .stream_arms import Host, Leg, StreamArms
from .upstream import ArmFailed

# Machines tried to rescue one broken stream, and arms that may serve one answer.
MAX_RESCUE_TRIES: Final = 3
MAX_LEGS: Final = 4


class Delivery:
    def __init__(self, host: Host, arms: StreamArms, leg: Leg) -> None:
        self.host = host
        self.arms = arms
        self.services = host.services
        self.now = host.services.now
        self.leg = leg
        self.legs = 1
        # The end of a leg that broke, recorded when its rescue began.
        self.broken: ArmEnd | None = None

    async def deliver(self, client: ClientStream) -> web.StreamResponse | None:
        """Commit the stream to the client and relay it to its end. Buffered (SPEC E5): held
        until complete and judged; None when it failed unseen (the exchange moves on)."""
        assert self.leg.opened is not None
        try:
            await client.start(served_headers(self.leg.run, self.leg.opened.model))
            if not client.holding:
                self.host.decision.first_content_at = self.now()
            return await self._relay(client)
        except ClientGone:
            self._left(self.leg.run.end(Cause.CLIENT_LEFT, self.now(),
                                        "the client went away mid-stream"))  # fmt: skip
            self.host.decision.outcome = OutcomeKind.CANCELLED
            assert client.response is not None
            return client.response
        except asyncio.CancelledError:
            self._left(self.services.cancelled(self.leg.run, "mid-stream"))
            raise

    async def _relay(self, client: ClientStream) -> web.StreamResponse | None:
        relay = self._relay_of(client, may_move=True)
        try:
            while True:
                stop = await relay.run()
                self._kept(relay)
                if stop.kind is StopKind.DONE:
                    return await self._done(client, stop)
                relay.close()
                if stop.kind is StopKind.BROKE:
                    rescued = await self._rescue(client, stop)
                    if rescued is None:
                        return await self._broke(client, stop)
                    relay = rescued
                    continue
                assert stop.act is not None
                moved = await self._move(client, stop.act)
                if moved is None:
                    relay.may_move = False  # kept: the slow stream goes on
                else:
                    relay = moved
        finally:
            relay.close()

    def _relay_of(self, client: ClientStream, *, may_move: bool) -> Relay:
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        assert run.watch is not None
        return Relay(opened, client, run.watch, run.silence, self.now, may_move=may_move)

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

    # -- the ends -------------------------------------------------------------------------

    async def _done(self, client: ClientStream, stop: Stop) -> web.StreamResponse | None:
        """The answer is complete: nothing more is read or awaited. Live, the client has it;
        buffered, it is judged first, and one whose verdict counts is replaced unseen."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        provider = run.attempt.provider.name
        if stop.supplied_done:
            self.services.recorder.noticed(provider, ProtocolQuirk.MISSING_DONE)
        if stop.usage_estimated and not client.delivered.spliced:
            self.services.recorder.noticed(provider, ProtocolQuirk.MISSING_USAGE)
        delivered = client.delivered
        verdict = verdict_on(self.host.chat, delivered.text, delivered.finish_reason,
                             delivered.has_tool_calls)  # fmt: skip
        answer = self._answer(client)
        if client.holding:
            if verdict.counts(run.attempt.provider.degraded_output):
                detail = f"answered a buffered stream that is {verdict.kind.value}"
                self.host.fail(run.end(Cause.DEGRADED, self.now(), detail, verdict=verdict,
                                       answer=answer))  # fmt: skip
                client.discard()
                return None
            await client.release()
            self.host.decision.first_content_at = self.now()
        end = run.end(Cause.ANSWERED, self.now(), "answered", verdict=verdict, answer=answer)
        self.host.served(end)
        assert client.response is not None
        return client.response

    def _broken(self, client: ClientStream, stop: Stop) -> ArmEnd:
        """The serving leg's end, broken after content: the upstream's fault."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        end = run.end(stop.cause, self.now(), f"stream broke after content: {stop.detail}",
                      answer=self._answer(client))  # fmt: skip
        end.delivered = True
        return end

    async def _broke(self, client: ClientStream, stop: Stop) -> web.StreamResponse | None:
        """Nobody could continue: the client gets an error event, and the request is over.
        The broken leg is what was served (its end is recorded once, whoever tells it).
        Buffered, the client saw none of it: a failure like any other (None)."""
        if client.holding:
            if self.broken is None:
                end = self._broken(client, stop)
                end.delivered = False
                self.host.fail(end)
            self.leg.recorded = True
            client.discard()
            return None
        if self.broken is None:
            self.host.served(self._broken(client, stop))
        else:
            self.host.served(self.broken, recorded=True)
        self.leg.recorded = True
        await client.fail(stop.detail)
        assert client.response is not None
        return client.response

    # -- handing the answer over ----------------------------------------------------------

    async def _move(self, client: ClientStream, act: Act) -> Relay | None:
        """A rate act after content reached the client: the alternative continues the
        delivered text in the same stream, or (it cannot start) the slow stream is kept."""
        assert act.alternative is not None
        role = self.host.chat.role.name
        slow = None
        if self.legs < MAX_LEGS:
            # Held, not yet seen: a machine that cannot continue starts the answer afresh.
            afresh = client.holding and not act.alternative.continues_partial
            slow = await self._continue_on(client, act.alternative.key, afresh=afresh)
        if slow is None:
            self.services.recorder.act(role, act, "kept")
            return None
        slow.run.act = ArmAct.CONTINUED
        detail = f"moved ({act.reason.value}) after {act.tokens} tokens: {act.detail}"
        self.host.record(slow.run.end(Cause.MOVED, self.now(), detail))
        self.services.recorder.act(role, act, "continued")
        return self._relay_of(client, may_move=False)

    async def _rescue(self, client: ClientStream, stop: Stop) -> Relay | None:
        """A stream that broke after content: the answer continues on the first machine
        that can take it over (SPEC E5), or None."""
        if self.legs >= MAX_LEGS or self.now() >= self.host.deadline:
            return None
        broken = self.leg
        failed = self.arms.key(broken.run)
        avoid: set[MachineKey] = set() if failed is None else {failed}
        plan = self.arms.plan()
        targets = plan.continuers(broken.run.attempt.model.name, avoid)
        if failed is not None and failed in plan.continuers(failed.model):
            # The machine that broke, last: a cut is often a blip, and it can continue.
            targets.append(failed)
        if not targets:
            return None
        self.broken = self._broken(client, stop)
        self.host.fail(self.broken)
        broken.recorded = True
        for target in targets[:MAX_RESCUE_TRIES]:
            if await self._continue_on(client, target) is not None:
                self.broken = None
                return self._relay_of(client, may_move=False)
        return None

    async def _continue_on(
        self, client: ClientStream, target: MachineKey, *, afresh: bool = False
    ) -> Leg | None:
        """Send `target` the request plus what was delivered; when it produces content it
        serves the client from the end of what the client has, and the leg it took over
        from is returned. `afresh` (a held answer): the plain request, and what was held is
        dropped. A failure is recorded (None)."""
        attempt = self.host.onward(target.provider, target.model, target.machine)
        if attempt is None:
            return None
        delivered = client.delivered
        budget = max(self.host.deadline - self.now(), 0.0)
        done = 0 if afresh else delivered.content_deltas
        onward = self.arms.run(attempt, budget, ArmAct.CONTINUED, done)
        chat = self.host.chat if afresh else self.host.chat.continued(delivered.text)
        try:
            opened = await self.arms.open(onward, chat)
        except ArmFailed as failure:
            # A machine refusing the prefill is one failed continuation, not the answer.
            self.host.fail(onward.failed(failure, self.now()))
            return None
        previous = self.leg
        if previous.opened is not None:
            previous.opened.close()
        self.leg = Leg(onward, opened)
        self.legs += 1
        if afresh:
            client.discard()
        else:
            client.splice()
        return previous

    def _left(self, end: ArmEnd) -> None:
        """The client went away (or we shut down) while this leg served it."""
        if self.leg.opened is not None:
            self.leg.opened.close()
        if not self.leg.recorded:
            self.host.record(end)
