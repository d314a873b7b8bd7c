"""A provider dialect is two rows: its wire protocol and its routing topology. A `Dialect`
value missing from either table would fail at the first request; here it fails at once."""

from __future__ import annotations

from rolegate_policy.enums import Dialect
from rolegate_proxy.core.routing import ROUTES_MACHINES
from rolegate_proxy.wire import openai
from rolegate_proxy.wire.dialects import WIRE


def test_every_dialect_has_a_wire_protocol_and_a_topology() -> None:
    assert set(WIRE) == set(Dialect)
    assert set(ROUTES_MACHINES) == set(Dialect)


def test_the_two_dialects_of_today_differ_in_topology_only() -> None:
    assert WIRE[Dialect.OPENAI] is WIRE[Dialect.AGGREGATOR] is openai
    assert ROUTES_MACHINES == {Dialect.OPENAI: False, Dialect.AGGREGATOR: True}
