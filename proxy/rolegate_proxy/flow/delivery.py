"""Delivering a streamed answer once its first output reached the client (SPEC B5, B6,
E4, E5, E7): the relay, moving a stream far slower than the best alternative, and rescuing
one that broke.

After content reached the client, two things can hand the answer to another machine, and
both splice its continuation into the same client stream: the machine is sent the request
plus the text already delivered as a partial assistant message (its token limits less what
was delivered), and what it writes follows what the client has, nothing repeated (an echo
of the prefill is dropped), nothing lost, stop sequences kept across the seam.

* A rate act (the stream fell decisively behind, or went silent) moves it to the act's
  alternative when that one continues partial messages; otherwise the slow stream is kept
  (never cut for slowness alone) and the act counted as kept. While the alternative is
  opened the slow stream is left unread, and that pause is ours, never its silence
  (`Relay.paused`).
* A held answer nobody has seen (a buffered role's, or one that is a tool call alone)
  moved to a machine that starts afresh is a race (SPEC B6): the held stream goes on
  being read while the alternative opens. If the held answer is complete and passes its
  judgment first, it is delivered and the alternative cancelled; a complete answer is
  never thrown away for a slower one. If the alternative's first content comes first, it
  serves from the start, unseen; if the held stream breaks meanwhile, the alternative is
  its replacement.
* A break (cut, in-band error, stall, or tool calls judged broken) is rescued by the first
  admissible machine that continues partial messages: the same model's first, then the
  role's other models. A machine that refuses the prefill (a 400) is one failed rescue,
  never the answer while another remains. With none, the client gets an error event, never
  a truncated answer presented as complete.

No machine this request left (`memory.py`: it failed, refused, lost a race or was moved
away from) is moved, raced or rescued to, except the machine that just broke, last, when
its break was transient and the request saw nothing else of it (SPEC B9).

Tool calls are held until the answer is complete and judged (`ClientStream.hold_tools`):
a break or move inside them drops what was held, and the machine that takes over writes
its own; the client never sees a partial call, a call twice, or one made by two machines.
A request for several answers (`n` > 1) is never spliced.

The client leaving ends the serving arm as the client's doing, never the upstream's.
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web

from rolegate_policy.model import DegradedOutputSpec
from rolegate_policy.status import ProtocolQuirk

from ..core.arm_end import Answered, ArmEnd, Cause
from ..core.beliefs import MachineKey
from ..core.outcomes import ArmAct, OutcomeKind
from ..core.splice import Splice
from ..core.verdicts import Verdict
from ..core.watch import Act
from .arms import verdict_on
from .client_stream import ClientGone, ClientStream
from .held_race import HeldRace
from .memory import TRANSIENT
from .seam import Seam
from .services import served_headers
from .stream import OpenedStream, Relay, Stop, StopKind
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
        # The text the serving leg continues (its seam with what the client has); None
        # for a leg that starts the answer. And whether its machine echoes that text.
        self.seam: str | None = None
        self.echoes = False
        # The alternative racing a held answer, while it opens.
        self.race: HeldRace | None = None
        # The race that made this leg the winner left machines this watch still offered.
        assert leg.run.watch is not None
        arms.forget_left(leg.run.watch)

    async def deliver(self, client: ClientStream) -> web.StreamResponse | None:
        """Commit the stream to the client and relay it to its end. Held (a buffered role,
        tool calls): released once complete and judged; None when it failed showing the
        client nothing (the exchange moves on)."""
        assert self.leg.opened is not None
        try:
            await client.start(served_headers(self.leg.run, self.leg.opened.model))
            return await self._relay(client)
        except ClientGone:
            self._drop_race()
            self._left(self.leg.run.end(Cause.CLIENT_LEFT, self.now(),
                                        "the client went away mid-stream"))  # fmt: skip
            self.host.decision.outcome = OutcomeKind.CANCELLED
            self._shown(client)
            assert client.response is not None
            return client.response
        except asyncio.CancelledError:
            self._drop_race()
            self._left(self.services.cancelled(self.leg.run, "mid-stream"))
            self._shown(client)
            raise

    async def _relay(self, client: ClientStream) -> web.StreamResponse | None:
        relay = self._relay_of(client, may_move=True)
        try:
            while True:
                stop = await self._run(client, relay)
                self._kept(relay)
                if isinstance(stop, Relay):  # the race's alternative serves from here
                    relay.close()
                    relay = stop
                    continue
                if stop.kind is StopKind.DONE:
                    verdict = self._judged(client)
                    if not (client.holding and verdict.counts(self._degraded)):
                        # Complete and judged: delivered, whatever is still opening.
                        if self.race is not None:
                            await self.race.lost()
                            self.race = None
                        return await self._done(client, stop, verdict)
                    # A held answer judged broken (empty, mangled, a broken tool call):
                    # replaced like one that broke, unseen.
                    stop = Stop(StopKind.BROKE, Cause.DEGRADED,
                                f"answered a stream that is {verdict.kind.value}",
                                verdict=verdict)  # fmt: skip
                relay.close()
                if stop.kind is StopKind.BROKE:
                    replaced = await self._replaced(client, stop)
                    if replaced is not None:
                        relay = replaced
                        continue
                    if client.shown and self._at_limit(client):
                        return await self._capped(client, stop)
                    rescued = await self._rescue(client, stop)
                    if rescued is None:
                        return await self._broke(client, stop)
                    relay = rescued
                    continue
                assert stop.act is not None
                moved = await self._move(client, stop.act, relay)
                if moved is None:
                    relay.may_move = False  # kept (or raced): the slow stream goes on
                else:
                    relay = moved
        finally:
            relay.close()
            self._drop_race()

    def _relay_of(self, client: ClientStream, *, may_move: bool) -> Relay:
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        assert run.watch is not None
        seam = None
        if self.seam is not None:
            splice = Splice(self.seam, self.host.chat.stops, echoes=self.echoes)
            # Once the client has content, a continuation's thinking aloud is not spliced
            # after it (SPEC E7).
            seam = Seam(splice, drop_reasoning=bool(self.seam))
        return Relay(opened, client, run.watch, run.silence, self.now, may_move=may_move, seam=seam)

    def _kept(self, relay: Relay) -> None:
        role = self.host.chat.role.name
        for act in relay.kept:
            self.services.recorder.act(role, act, "kept")
            run = self.leg.run
            run.act = run.act or ArmAct.KEPT
        relay.kept.clear()

    @property
    def _degraded(self) -> DegradedOutputSpec:
        return self.leg.run.attempt.provider.degraded_output

    def _judged(self, client: ClientStream) -> Verdict:
        delivered = client.delivered
        tools = delivered.tools
        return verdict_on(
            self.host.chat, delivered.text, delivered.finish_reason,
            tool_calls=() if tools is None else tools.calls(), refusal=delivered.refused,
        )  # fmt: skip

    def _answer(self, client: ClientStream) -> Answered:
        delivered = client.delivered
        finish = delivered.finish_reason
        return Answered(
            finish, delivered.prompt_tokens, delivered.completion_tokens, delivered.pieces,
            capped_by_upstream=finish == "length" and not self.host.chat.client_capped(finish),
        )  # fmt: skip

    def _at_limit(self, client: ClientStream) -> bool:
        """What was delivered already reaches the caller's token limit."""
        budget = self.host.chat.token_budget(client.continuable.most_tokens)
        return budget is not None and budget <= 0

    # -- the ends -------------------------------------------------------------------------

    async def _done(
        self, client: ClientStream, stop: Stop, verdict: Verdict
    ) -> web.StreamResponse | None:
        """The answer is complete: nothing more is read or awaited. What was held (a
        buffered answer, tool calls) goes out now that it is judged."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        provider = run.attempt.provider.name
        if stop.supplied_done:
            self.services.recorder.noticed(provider, ProtocolQuirk.MISSING_DONE)
        if stop.usage_estimated and not client.delivered.spliced:
            self.services.recorder.noticed(provider, ProtocolQuirk.MISSING_USAGE)
        answer = self._answer(client)
        if client.holding:
            await client.release()
        self._shown(client)
        end = run.end(Cause.ANSWERED, self.now(), "answered", verdict=verdict, answer=answer)
        self.host.served(end)
        assert client.response is not None
        return client.response

    def _shown(self, client: ClientStream) -> None:
        """When the client first saw the answer (a held one: when it was released)."""
        if client.shown_at is not None:
            self.host.decision.first_content_at = client.shown_at

    def _broken(self, client: ClientStream, stop: Stop) -> ArmEnd:
        """The serving leg's end, broken after its first output: the upstream's fault."""
        run, opened = self.leg.run, self.leg.opened
        assert opened is not None
        opened.close()
        end = run.end(stop.cause, self.now(), f"stream broke after content: {stop.detail}",
                      verdict=stop.verdict, answer=self._answer(client))  # fmt: skip
        end.delivered = client.shown
        return end

    async def _broke(self, client: ClientStream, stop: Stop) -> web.StreamResponse | None:
        """Nobody could continue. When the client saw none of the answer, a failure like
        any other (None): the exchange moves on. Otherwise it gets an error event, and the
        request is over; the broken leg is what was served (its end recorded once,
        whoever tells it)."""
        if not client.shown:
            if self.broken is None:
                self.host.fail(self._broken(client, stop))
            self.leg.recorded = True
            client.discard()
            return None
        if self.broken is None:
            self.host.served(self._broken(client, stop))
        else:
            self.host.served(self.broken, recorded=True)
        self.leg.recorded = True
        self._shown(client)
        await client.fail(stop.detail)
        assert client.response is not None
        return client.response

    async def _capped(self, client: ClientStream, stop: Stop) -> web.StreamResponse:
        """It broke once the answer had reached the caller's token limit: nothing may be
        asked of another machine, and the caller has what it asked for. The answer ends
        as a limit ends it (`length`); the break is still the upstream's."""
        client.back_to_mark()
        end = self.broken or self._broken(client, stop)
        self.host.served(end, recorded=self.broken is not None)
        # The client has the whole answer it asked for: answered, not incomplete.
        self.host.decision.outcome = None
        self.leg.recorded = True
        await client.finish(b"", reason="length")
        self._shown(client)
        assert client.response is not None
        return client.response

    # -- handing the answer over ----------------------------------------------------------

    async def _move(self, client: ClientStream, act: Act, relay: Relay) -> Relay | None:
        """A rate act after content reached the client: the alternative continues the
        delivered text in the same stream, or (it cannot start) the slow stream is kept.
        A held answer nobody saw that the alternative would start afresh is raced instead
        (None: the held stream goes on beside it)."""
        assert act.alternative is not None
        role = self.host.chat.role.name
        slow = None
        if self._may_splice() and not self._at_limit(client):
            # Nothing seen yet: a machine that cannot continue starts the answer afresh.
            afresh = not client.shown and (
                not act.alternative.continues_partial or not client.continuable.texts
            )
            if afresh:
                if self._race(act):
                    return None
            else:
                # The slow stream waits unread while the alternative opens: our pause.
                with relay.paused():
                    slow = await self._continue_on(client, act.alternative.key)
        if slow is None:
            self.services.recorder.act(role, act, "kept")
            return None
        slow.run.act = ArmAct.CONTINUED
        detail = f"moved ({act.reason.value}) after {act.tokens} tokens: {act.detail}"
        self.host.record(slow.run.end(Cause.MOVED, self.now(), detail))
        self.services.recorder.act(role, act, "continued")
        return self._relay_of(client, may_move=False)

    # -- a race for a held answer -----------------------------------------------------------

    def _race(self, act: Act) -> bool:
        """Start the act's alternative beside the held answer (False: it may not be sent)."""
        budget = max(self.host.deadline - self.now(), 0.0)
        run = self.arms.rival(act, self.leg.run, budget)
        if run is None:
            return False
        self.race = HeldRace(self.host, self.arms, run, act)
        return True

    async def _run(self, client: ClientStream, relay: Relay) -> Stop | Relay:
        """The relay to its next stop; during a race, beside the alternative, whose relay
        is returned when its first content came first."""
        race = self.race
        if race is None:
            return await relay.run()
        got = await race.beside(relay)
        if isinstance(got, Stop):
            if race.failed:
                self.race = None
            return got
        self.race = None
        act = race.act
        detail = f"lost the race; raced ({act.reason.value}) after {act.tokens} tokens"
        ended = self.leg.run.end(Cause.RACE_LOST, self.now(), f"{detail}: {act.detail}")
        self._take_over(client, race, got, ended)
        return self._relay_of(client, may_move=False)

    async def _replaced(self, client: ClientStream, stop: Stop) -> Relay | None:
        """The held stream broke (or was judged broken) during a race: the alternative, once
        open, replaces it unseen; None when there is no race or it failed too."""
        race = self.race
        if race is None:
            return None
        # Kept until it settles: a client leaving meanwhile drops it (`_drop_race`).
        opened = await race.replacement()
        self.race = None
        if opened is None:
            return None
        self._take_over(client, race, opened, self._broken(client, stop), failed=True)
        return self._relay_of(client, may_move=False)

    def _take_over(
        self, client: ClientStream, race: HeldRace, opened: OpenedStream, ended: ArmEnd,
        *, failed: bool = False,
    ) -> None:  # fmt: skip
        """The race's alternative serves from the start: the held leg ends (`ended`), and
        what it held is dropped unseen."""
        previous = self.leg
        if previous.opened is not None:
            previous.opened.close()
        if failed:
            self.host.fail(ended)
        else:
            self.host.record(ended)
        self.leg = Leg(race.run, opened)
        self.legs += 1
        self.seam = None
        self.echoes = False
        client.back_to_mark()
        client.discard()

    def _drop_race(self) -> None:
        race, self.race = self.race, None
        if race is not None:
            race.drop()

    def _may_splice(self) -> bool:
        """Another arm may still take the answer over: legs left, and one answer asked
        for (several are never spliced from two machines)."""
        return self.legs < MAX_LEGS and self.host.chat.choices == 1

    async def _rescue(self, client: ClientStream, stop: Stop) -> Relay | None:
        """A stream that broke after its first output: the answer continues on the first
        machine that can take it over (SPEC E5), or None. Tool calls held when it broke
        are dropped: the machine that takes over writes its own."""
        if not self._may_splice() or self.now() >= self.host.deadline:
            return None
        if not client.shown and not client.continuable.texts:
            return None  # nothing to go on from: the exchange starts the answer afresh
        broken = self.leg
        failed = self.arms.key(broken.run)
        memory = self.host.memory
        avoid = {*memory.all_avoided(continuation=True), *(() if failed is None else (failed,))}
        plan = self.arms.plan()
        targets = plan.continuers(broken.run.attempt.model.name, avoid)
        if (
            failed is not None
            and stop.cause in TRANSIENT
            and memory.why(failed) is None
            and failed in plan.continuers(failed.model)
        ):
            # The machine that broke, last: a cut is often a blip, and it can continue (the
            # same model retried for a transient fault, SPEC B9).
            targets.append(failed)
        if not targets:
            return None
        self.broken = self._broken(client, stop)
        self.host.fail(self.broken)
        broken.recorded = True
        for target in targets[:MAX_RESCUE_TRIES]:
            if await self._continue_on(client, target, retry=target == failed) is not None:
                self.broken = None
                return self._relay_of(client, may_move=False)
        return None

    async def _continue_on(
        self, client: ClientStream, target: MachineKey, *, retry: bool = False
    ) -> Leg | None:
        """Send `target` the request plus the text delivered (less any tool calls held);
        when it produces its first output it serves the client from there, and the leg it
        took over from is returned. No text delivered: the plain request, and what the
        client was not shown is dropped. A failure is recorded (None). `retry`: `target`
        is the machine that just broke, for a transient fault (`Exchange.onward`)."""
        base = client.continuable
        afresh = not base.texts
        attempt = self.host.onward(
            target.provider, target.model, target.machine, continuation=not afresh, retry=retry
        )
        if attempt is None:
            return None
        seam = None if afresh else base.text
        budget = max(self.host.deadline - self.now(), 0.0)
        spent = 0 if afresh else base.most_tokens
        onward = self.arms.run(attempt, budget, ArmAct.CONTINUED, spent)
        chat = self.host.chat if seam is None else self.host.chat.continued(seam, spent)
        try:
            opened = await self.arms.open(onward, chat)
        except ArmFailed as failure:
            # A machine refusing the prefill is one failed continuation, not the answer.
            self.host.fail(onward.failed(failure, self.now()), continuation=seam is not None)
            return None
        previous = self.leg
        if previous.opened is not None:
            previous.opened.close()
        self.leg = Leg(onward, opened)
        self.legs += 1
        self.seam = seam
        self.echoes = self._echoes(target)
        client.back_to_mark()
        if afresh and not client.shown:
            client.discard()
        else:
            client.splice()
        return previous

    def _echoes(self, target: MachineKey) -> bool:
        """Whether the machine is declared to repeat the partial message it continues."""
        provider = self.host.config.provider(target.provider)
        model = None if provider is None else provider.model(target.model)
        machine = None if model is None else model.machine(target.machine)
        return machine is not None and machine.echoes_partial_message

    def _left(self, end: ArmEnd) -> None:
        """The client went away (or we shut down) while this leg served it."""
        if self.leg.opened is not None:
            self.leg.opened.close()
        if not self.leg.recorded:
            self.host.record(end)
