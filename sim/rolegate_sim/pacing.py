"""When each token of a reply (each piece of an answer with reasoning or tool calls) is due.

Deadlines are absolute (loop time), not a sleep per token, so scheduling overhead never
accumulates into drift and a machine with no TTFT and no rate limit never sleeps at all.
"""

from __future__ import annotations

import random

from rolegate_sim.scenario import RateCollapseFault


class Pacer:
    __slots__ = ("_collapse", "_due", "_index", "_interval", "_jitter", "_rng", "_start", "_ttft")

    def __init__(
        self,
        *,
        start: float,
        ttft_seconds: float,
        tokens_per_second: float,
        jitter: float,
        rng: random.Random | None,
        collapse: RateCollapseFault | None = None,
    ) -> None:
        self._start = start
        self._ttft = ttft_seconds
        self._interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        # Jitter needs the request's RNG; without one it is simply off.
        self._jitter = jitter if rng is not None else 0.0
        self._rng = rng
        self._collapse = collapse
        self._index = 0
        self._due = start

    def next_due(self) -> float:
        """Loop time at which the next piece's event (piece 0, 1, ...) may be sent."""
        index = self._index
        self._index = index + 1
        if index == 0:
            self._due = self._start + self._scaled(self._ttft)
        else:
            interval = self._interval
            collapse = self._collapse
            if collapse is not None and index >= collapse.after_tokens:
                interval = 1.0 / collapse.tokens_per_second
            if interval:
                self._due += self._scaled(interval)
        return self._due

    def delay(self, seconds: float) -> None:
        """Push every later deadline back (a stall)."""
        self._start += seconds
        self._due += seconds

    def _scaled(self, seconds: float) -> float:
        if not self._jitter or not seconds:
            return seconds
        assert self._rng is not None
        return seconds * (1.0 + self._rng.uniform(-self._jitter, self._jitter))
