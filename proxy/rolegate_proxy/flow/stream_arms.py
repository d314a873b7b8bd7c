"""Making and opening the streamed arms of one request: what the first content's race
(`serving.py`) and the delivery's moves and rescues (`delivery.py`) both need."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from rolegate_policy.config import ProxyConfig
from rolegate_policy.enums import Delivery
from rolegate_policy.status import ProtocolQuirk

from ..core.arm_end import ArmEnd
from ..core.beliefs import MachineBelief, MachineKey
from ..core.choice import Alternative, Plan
from ..core.decisions import Decision
from ..core.outcomes import ArmAct
from ..core.routing import Attempt
from ..core.watch import Act, Watch
from ..wire.chat_request import ChatRequest
from .arms import ArmRun, StreamHooks, open_stream
from .client_stream import ClientStream
from .memory import RequestMemory
from .services import Services
from .stream import OpenedStream
from .upstream import Silence

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

    @property
    def deadline(self) -> float: ...

    @property
    def memory(self) -> RequestMemory: ...

    def client_stream(self) -> ClientStream: ...

    def counted(self, run: ArmRun) -> ArmRun: ...

    def onward(
        self,
        provider: str,
        model: str,
        machine: str,
        *,
        continuation: bool = False,
        retry: bool = False,
    ) -> Attempt | None: ...

    def record(self, end: ArmEnd, *, continuation: bool = False) -> None: ...

    def fail(self, end: ArmEnd, *, continuation: bool = False) -> None: ...

    def served(self, end: ArmEnd, *, recorded: bool = False) -> None: ...

    async def send_fresh_once(self, run: ArmRun, send: Callable[[bool], Awaitable[T]]) -> T: ...


@dataclass(slots=True)
class Leg:
    """The arm serving the client now, and its stream."""

    run: ArmRun
    opened: OpenedStream | None = None
    # Its end is recorded (a stream that broke after content): the client leaving while
    # it is told so ends nothing more.
    recorded: bool = False


class StreamArms:
    """Streamed arms of one request: each with its watch, each opened up to its first
    content."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.services = host.services
        self.now = host.services.now

    def plan(self) -> Plan:
        """The request's plan now: every candidate's admitted machines."""
        services, chat = self.services, self.host.chat
        candidates = services.candidates(chat.role, self.host.config)
        return services.chooser.plan(chat.role, candidates, services.breakers.exclusion, self.now())

    def frontier(self) -> tuple[Alternative, ...]:
        """What the rate test compares the serving machine with: the chooser's frontier
        (kept per role) while this request has left no machine; once it has, the plan's
        with those machines avoided (SPEC B9: never moved or raced back to a machine it
        left; the kept frontier, cut to what wins with any one machine left out, could
        miss the machine that wins with two left out). Either way without the models that
        refused this request's body for its length."""
        services, chat = self.services, self.host.chat
        candidates = services.candidates(chat.role, self.host.config)
        memory = self.host.memory
        if not memory.machines and not memory.bodies:
            return services.chooser.frontier(
                chat.role, candidates, services.breakers.exclusion, self.now()
            )
        plan = services.chooser.plan(
            chat.role, candidates, services.breakers.exclusion, self.now(),
            avoid=memory.all_avoided(),
        )  # fmt: skip
        return tuple(
            alternative
            for alternative in plan.frontier()
            if memory.body_refused(alternative.key.model, continuation=True) is None
        )

    def forget_left(self, watch: Watch) -> None:
        """A watch made before this request left some machines (a race's loser is known
        only once the race is over): its frontier is made again without them."""
        memory = self.host.memory
        serving = watch.serving
        if serving is None or not any(memory.why(a.key) for a in watch.frontier):
            return
        watch.frontier = self.frontier()
        # (Its alternatives are sorted again as when the machine serving is named.)
        watch.identify(serving, watch.belief)

    def run(
        self, attempt: Attempt, budget: float, act: ArmAct | None = None, delivered: int = 0
    ) -> ArmRun:
        """An arm about to be sent, with the mid-stream rate test (SPEC B5) against the
        request's frontier; `delivered`: content deltas earlier arms delivered."""
        now = self.now()
        run = ArmRun(attempt, now, True, Silence.for_arm(attempt, budget, stream=True), act)
        key = self.key(run)
        belief = None if key is None else self.services.recorder.ledger.belief_of(key, now)
        # The wait expected in its machine's queue, read before the arm joins it.
        queued = self._queue_wait(attempt, key, belief, now)
        self.host.counted(run)
        run.watch = Watch(
            self.host.chat.role,
            sent_at=run.started,
            started_at=self.host.decision.started_at,
            serving=key,
            belief=belief,
            queued=queued,
            frontier=self.frontier(),
            # Buffered, nothing reaches the client before the end: any alternative can take
            # over (afresh), not only one that continues partial messages.
            streams_to_client=self.host.chat.role.delivery is not Delivery.BUFFERED,
            delivered=delivered,
        )
        return run

    def rival(self, act: Act, racing: ArmRun, budget: float) -> ArmRun | None:
        """The arm a race starts on `act`'s alternative beside `racing` (SPEC B6), the act
        recorded; None when the request may not send it there (`Host.onward`)."""
        assert act.alternative is not None
        target = act.alternative.key
        attempt = self.host.onward(target.provider, target.model, target.machine)
        if attempt is None:
            return None
        self.services.recorder.act(self.host.chat.role.name, act, "raced")
        racing.act = ArmAct.RACED
        return self.run(attempt, budget, ArmAct.RACED)

    def _queue_wait(
        self, attempt: Attempt, key: MachineKey | None, belief: MachineBelief | None, now: float
    ) -> float:
        """The seconds an arm sent now to `key` is expected to wait in its queue (SPEC B8;
        0 when its machine or its expected time is unknown)."""
        load = self.services.upstreams.load
        if key is None or belief is None or load.in_flight(key, now) == 0:
            return 0.0
        service = belief.expected_seconds(self.host.chat.role.expected_output_tokens)
        if service is None:
            return 0.0
        machine = attempt.model.machine(key.machine)
        published = None if machine is None else machine.max_concurrency
        return load.wait_seconds(key, service, published, now)

    @staticmethod
    def key(run: ArmRun) -> MachineKey | None:
        machine = run.machine
        attempt = run.attempt
        return (
            None
            if machine is None
            else MachineKey(attempt.provider.name, attempt.model.name, machine)
        )

    async def open(self, run: ArmRun, chat: ChatRequest) -> OpenedStream:
        """Send the arm and hold it until its first content (raises ArmFailed)."""
        recorder = self.services.recorder
        provider = run.attempt.provider.name

        def named(machine: str) -> None:
            run.name(machine)
            key = self.key(run)
            if run.watch is not None and key is not None and key != run.watch.serving:
                run.watch.identify(key, recorder.ledger.belief_of(key, self.now()))

        hooks = StreamHooks(
            clock=self.now,
            named=named,
            malformed=recorder.metrics.malformed_events.labels(provider).inc,
            missing_charset=lambda: recorder.noticed(provider, ProtocolQuirk.MISSING_CHARSET),
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
