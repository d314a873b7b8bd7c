"""The proxy's routing state, shared by every request, and the entry to the request path.

One `Dispatcher` per proxy process holds what requests learn from and decide with: the
breakers, the ledger of beliefs, the scores, the chooser (with its affinity pins), the
verdict log, the recorder that feeds them all, and the upstream sessions. `handle` runs one
request as an `Exchange` (flow/exchange.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rolegate_policy.config import ProxyConfig

from ..core.arm_end import Cause
from ..core.beliefs import Ledger
from ..core.breaker import Breakers
from ..core.chooser import Chooser
from ..core.decisions import Decision
from ..core.exclusions import Transition
from ..core.load import Load
from ..core.score import Scoreboard
from ..core.verdicts import VerdictLog
from ..wire.chat_request import ChatRequest
from .client_stream import KEEPALIVE_SECONDS
from .exchange import Exchange
from .metrics import ProxyMetrics
from .recorder import Recorder
from .services import Services
from .upstream import Upstreams


@dataclass
class Dispatcher:
    breakers: Breakers
    verdicts: VerdictLog
    rng: random.Random
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    # What each machine is believed to do, and who may be sent to (SPEC B1-B4, B7).
    ledger: Ledger = field(default_factory=Ledger)
    # Each machine's operational and semantic quality (SPEC C1-C3), fed by the outcomes.
    scores: Scoreboard = field(default_factory=Scoreboard)
    # Requests in flight per machine, and each machine's concurrency (SPEC B8): every arm
    # takes a ticket when sent (flow/arms.py), routing reads the queues.
    load: Load = field(default_factory=Load)
    # The share of routing decisions that explore (a machine other than the best leads),
    # for a role without an explorationShare of its own.
    explore: float = 0.02
    # How often a buffered stream's caller hears that the answer is being worked on.
    keepalive_seconds: float = KEEPALIVE_SECONDS
    chooser: Chooser = field(init=False)
    recorder: Recorder = field(init=False)
    # Set when the app's upstream sessions start.
    upstreams: Upstreams | None = None
    # Set when the proxy begins to shut down: from then on an arm cancelled under a request
    # was ended by the shutdown, not by its client.
    shutting_down: bool = False
    # What every exchange is handed, made once the upstream sessions are there.
    _services: Services | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        breakers = self.breakers
        self.chooser = Chooser(
            self.ledger,
            scores=self.scores,
            draw=self.rng.random,
            explore=self.explore,
            exclusions_epoch=lambda: breakers.epoch,
            load=self.load,
        )
        self.recorder = Recorder(
            self.breakers, self.ledger, self.chooser, self.verdicts, self.metrics
        )

    @property
    def listeners(self) -> list[Callable[[Transition], None]]:
        """Who hears of every breaker transition (the status reporter, the demo)."""
        return self.recorder.listeners

    # The monotonic clock itself, not a method around it: asked a dozen times a request.
    now = staticmethod(time.monotonic)

    def _cancelled_by(self) -> Cause:
        return Cause.SHUTDOWN if self.shutting_down else Cause.CLIENT_LEFT

    def on_transition(self, transition: Transition) -> None:
        self.recorder.transitions([transition])

    def handle(
        self,
        request: web.Request,
        chat: ChatRequest,
        config: ProxyConfig,
        decision: Decision,
        headers: dict[str, str],
    ) -> Coroutine[Any, Any, web.StreamResponse]:
        """The request's exchange, for the caller to await (returned, not awaited here: a
        coroutine less for every step of the request to pass through)."""
        return Exchange(self._shared(), request, chat, config, decision, headers).run()

    def _shared(self) -> Services:
        services = self._services
        if services is None or services.upstreams is not self.upstreams:
            assert self.upstreams is not None, "the upstream sessions start with the app"
            services = self._services = Services(
                self.chooser, self.breakers, self.recorder, self.upstreams, self.rng.random,
                self.now, self._cancelled_by, self.keepalive_seconds,
            )  # fmt: skip
        return services
