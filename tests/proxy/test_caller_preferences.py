"""A caller's routing preferences are merged with its role's routing, never replacing it
and never widening it (SPEC F3): the pure merge, the parser, and end to end through the
simulator as the aggregator."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from rolegate_policy.config import CompiledRole
from rolegate_policy.enums import BypassField, Ruling, Visibility
from rolegate_proxy.core.routing import MachineRouting, RoutingKind
from rolegate_proxy.wire.aggregator import CallerRefusal, Merged, merge
from rolegate_proxy.wire.caller_provider import (
    CallerProvider,
    parse_caller_provider,
    refuse_bypass,
    refuse_unreachable,
)
from rolegate_proxy.wire.errors import ProxyError

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table, sim_records

# -- the pure merge: a table of caller preferences by role rulings ------------------------

ORDER = MachineRouting(RoutingKind.ORDER, ("a", "b", "c"), ("slow",))
ONLY = MachineRouting(RoutingKind.ONLY, ("a", "b"))
PRIVATE = {"data_collection": "deny", "zdr": True, "quantizations": ["fp8"]}


@pytest.mark.parametrize(
    ("routing", "caller", "field"),
    [
        # Nothing asked: the role's ruling as it was.
        (ORDER, {}, {"order": ["a", "b", "c"], "ignore": ["slow"], "allow_fallbacks": True}),
        (ONLY, {}, {"only": ["a", "b"], "allow_fallbacks": False}),
        # Privacy preferences are kept under either ruling, the ruling untouched.
        (
            ORDER,
            PRIVATE,
            {"order": ["a", "b", "c"], "ignore": ["slow"], "allow_fallbacks": True, **PRIVATE},
        ),
        (ONLY, PRIVATE, {"only": ["a", "b"], "allow_fallbacks": False, **PRIVATE}),
        # Their permissive values are the defaults: not sent, so they loosen nothing.
        (
            ONLY,
            {"data_collection": "allow", "zdr": False, "require_parameters": False},
            {"only": ["a", "b"], "allow_fallbacks": False},
        ),
        (
            ONLY,
            {
                "require_parameters": True,
                "enforce_distillable_text": True,
                "max_price": {"prompt": 1},
            },
            {
                "only": ["a", "b"],
                "allow_fallbacks": False,
                "require_parameters": True,
                "enforce_distillable_text": True,
                "max_price": {"prompt": 1},
            },
        ),
        # `only` is intersected with the admitted machines, in the role's order, and sent as
        # a demand the aggregator's fallbacks stay inside.
        (
            ORDER,
            {"only": ["c", "a", "elsewhere"]},
            {"order": ["a", "c"], "only": ["a", "c"], "ignore": ["slow"], "allow_fallbacks": True},
        ),
        (ONLY, {"only": ["b", "c"]}, {"only": ["b"], "allow_fallbacks": False}),
        # `ignore` joins the role's and leaves the machines it names.
        (
            ORDER,
            {"ignore": ["b", "unknown"]},
            {"order": ["a", "c"], "ignore": ["slow", "b", "unknown"], "allow_fallbacks": True},
        ),
        (ONLY, {"ignore": ["a"]}, {"only": ["b"], "allow_fallbacks": False}),
        # Declining fallbacks narrows an order; asking for them never loosens an only.
        (
            ORDER,
            {"allow_fallbacks": False},
            {"order": ["a", "b", "c"], "ignore": ["slow"], "allow_fallbacks": False},
        ),
        (ONLY, {"allow_fallbacks": True}, {"only": ["a", "b"], "allow_fallbacks": False}),
        # Rankings are the role's: the caller's order and sort are not sent.
        (
            ORDER,
            {"order": ["c", "b"], "sort": "price", "preferred_max_latency": 2},
            {"order": ["a", "b", "c"], "ignore": ["slow"], "allow_fallbacks": True},
        ),
        (
            ONLY,
            {"order": ["b"], "sort": {"by": "throughput"}},
            {"only": ["a", "b"], "allow_fallbacks": False},
        ),
    ],
)
def test_the_merge_narrows_and_keeps_never_widens(
    routing: MachineRouting, caller: dict[str, Any], field: dict[str, Any]
) -> None:
    merged = merge(routing, parse_caller_provider(caller))
    assert isinstance(merged, Merged)
    assert merged.field == field
    assert merged.routing.kind is routing.kind
    assert set(merged.routing.machines) <= set(routing.machines)
    # Idempotent: the flow narrows the routing when the attempt is admitted, the wire
    # spells it when it is sent.
    again = merge(merged.routing, parse_caller_provider(caller))
    assert isinstance(again, Merged)
    assert again.field == field


@pytest.mark.parametrize(
    ("routing", "caller", "named"),
    [
        (ORDER, {"only": ["elsewhere"]}, "provider.only"),
        (ONLY, {"only": ["c"]}, "provider.only"),
        (ONLY, {"ignore": ["a", "b"]}, "provider.ignore"),
        (ORDER, {"only": ["a"], "ignore": ["a"]}, "provider.only"),
    ],
)
def test_nothing_left_is_a_refusal_that_names_the_field_not_the_values(
    routing: MachineRouting, caller: dict[str, Any], named: str
) -> None:
    merged = merge(routing, parse_caller_provider(caller))
    assert isinstance(merged, CallerRefusal)
    assert named in merged.reason
    assert "elsewhere" not in merged.reason


# -- the parser -------------------------------------------------------------------------

SECRET = "sk-caller-value-never-echoed"


@pytest.mark.parametrize(
    ("provider", "param"),
    [
        (SECRET, "provider"),
        ([SECRET], "provider"),
        ({"only": SECRET}, "provider.only"),
        ({"only": []}, "provider.only"),
        ({"ignore": [SECRET, 3]}, "provider.ignore"),
        ({"order": {"a": SECRET}}, "provider.order"),
        ({"data_collection": SECRET}, "provider.data_collection"),
        ({"zdr": SECRET}, "provider.zdr"),
        ({"allow_fallbacks": 1}, "provider.allow_fallbacks"),
        ({"quantizations": [SECRET] * 65}, "provider.quantizations"),
        ({"max_price": {"prompt": -1}}, "provider.max_price"),
        ({"max_price": SECRET}, "provider.max_price"),
        ({"sort": 3}, "provider.sort"),
        ({"preferred_min_throughput": SECRET}, "provider.preferred_min_throughput"),
        ({"models": ["x"]}, "provider.models"),
        ({SECRET: True}, "provider"),
    ],
)
def test_a_malformed_provider_object_is_a_400_naming_the_field(provider: Any, param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_caller_provider(provider)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, "invalid_provider")
    assert f"`{param}`" in error.message or param == "provider"
    assert SECRET not in error.message


def _role(*bypass: BypassField) -> CompiledRole:
    return CompiledRole(
        name="agent", source="test", models=("m",), patience_seconds=30,
        visibility=Visibility.WATCHED, ruling=Ruling.ORDER, effective_ruling=Ruling.ORDER,
        ruling_reason="declared", expected_output_tokens=512, caller_may_bypass=bypass,
    )  # fmt: skip


@pytest.mark.parametrize("bypass", list(BypassField))
def test_a_bypass_field_is_refused_unless_the_role_allows_it(bypass: BypassField) -> None:
    body = {"messages": [], bypass.value: [SECRET]}
    with pytest.raises(ProxyError) as caught:
        refuse_bypass(body, _role())
    error = caught.value
    assert (error.status, error.param, error.code) == (400, bypass.value, "field_not_allowed")
    assert error.message.startswith(f"`{bypass.value}` would ")
    assert "agent" in error.message
    assert "callerMayBypass" in error.message
    assert SECRET not in error.message
    refuse_bypass(body, _role(bypass))  # allowed: no error
    others = [b for b in BypassField if b is not bypass]
    with pytest.raises(ProxyError):
        refuse_bypass(body, _role(*others))


def test_only_outside_every_machine_of_the_role_is_a_400_listing_the_role_s_machines() -> None:
    role = _role()
    with pytest.raises(ProxyError) as caught:
        refuse_unreachable(parse_caller_provider({"only": [SECRET]}), role, ("a1", "b1"))
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "provider.only", "no_machine_left")
    assert "a1, b1" in error.message
    assert SECRET not in error.message
    with pytest.raises(ProxyError) as caught:
        refuse_unreachable(parse_caller_provider({"ignore": ["a1", "b1"]}), role, ("a1", "b1"))
    assert caught.value.param == "provider.ignore"
    for fine in ({}, {"only": ["b1", SECRET]}, {"ignore": ["a1"]}, {"zdr": True}):
        refuse_unreachable(parse_caller_provider(fine), role, ("a1", "b1"))


def test_no_provider_object_is_no_preference() -> None:
    assert parse_caller_provider(None) == CallerProvider()
    assert not parse_caller_provider({"zdr": True}).narrows_machines


# -- end to end: the simulator as the aggregator ----------------------------------------

A = "vendor/model-a"
B = "vendor/model-b"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _proxy(
    sim_server: SimFactory, proxy_server: ProxyFactory, **role_fields: Any
) -> tuple[str, str]:
    machines = [{"name": n, "ttftSeconds": 0, "tokensPerSecond": 0} for n in ("a1", "a2")]
    sim = await sim_server(
        {
            "seed": 3,
            "models": [
                {"name": A, "reply": "one two three", "machines": machines},
                {"name": B, "reply": "one two three", "machines": [{"name": "b1"}]},
            ],
        }
    )
    bypass = role_fields.pop("callerMayBypass", None)
    agent = role("agent", [A, B], **role_fields)
    if bypass is not None:
        agent["callerMayBypass"] = bypass
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {A: ["a1", "a2"], B: ["b1"]}),
            role_table(agent),
        ]
    )
    return proxy.url, sim.url


def _sent(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (record["provider"] or {}).items() if v is not None}


ONLY_ROLE: dict[str, Any] = {"visibility": "Unwatched", "patience": 3, "ruling": "Auto"}
ORDER_ROLE: dict[str, Any] = {"visibility": "Watched", "ruling": "Auto"}
ASKED = {"data_collection": "deny", "zdr": True, "quantizations": ["fp8", "bf16"]}


@pytest.mark.parametrize(
    ("role_fields", "caller", "expected", "machine"),
    [
        (
            ONLY_ROLE,
            # A caller's fallbacks and order cannot loosen or reorder the role's `only`.
            {**ASKED, "allow_fallbacks": True, "order": ["a2"]},
            {"only": ["a1", "a2"], "allow_fallbacks": False, **ASKED},
            "a1",
        ),
        (
            ORDER_ROLE,
            ASKED,
            {"order": ["a1", "a2"], "allow_fallbacks": True, **ASKED},
            "a1",
        ),
        (
            ORDER_ROLE,
            {"only": ["a2", "b1"], "ignore": ["z9"], "allow_fallbacks": False,
             "data_collection": "allow"},
            {"order": ["a2"], "only": ["a2"], "ignore": ["z9"], "allow_fallbacks": False},
            "a2",
        ),
    ],
)  # fmt: skip
async def test_the_aggregator_receives_the_caller_s_preferences_and_the_role_s_ruling(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    role_fields: dict[str, Any],
    caller: dict[str, Any],
    expected: dict[str, Any],
    machine: str,
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, **role_fields)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        answer = await client.chat.completions.with_raw_response.create(
            model="agent",
            messages=MESSAGES,  # type: ignore[arg-type]
            extra_body={"provider": caller},
        )
    assert answer.headers["x-rolegate-machine"] == machine
    (record,) = await sim_records(sim_url)
    assert _sent(record) == expected


async def test_only_narrows_across_the_role_s_models(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    # The first model has no machine the caller admits: that candidate is refused, as a
    # role's `Only` with no machine is, and the next model serves.
    url, sim_url = await _proxy(sim_server, proxy_server, **ONLY_ROLE)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": "agent", "messages": MESSAGES, "provider": {"only": ["b1"]}},
        )
    assert response.status_code == 200
    assert response.headers["x-rolegate-model"] == B
    (record,) = await sim_records(sim_url)
    assert (record["model"], _sent(record)) == (B, {"only": ["b1"], "allow_fallbacks": False})


async def test_only_outside_the_role_is_a_400_naming_the_field_and_the_role_s_machines(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, **ORDER_ROLE)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="agent",
                messages=MESSAGES,  # type: ignore[arg-type]
                extra_body={"provider": {"only": [SECRET]}},
            )
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("provider.only", "no_machine_left")
    assert "a1, a2, b1" in error["message"]
    assert SECRET not in caught.value.response.text
    assert await sim_records(sim_url) == []


async def test_a_malformed_provider_object_is_refused_before_anything_is_sent(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, **ORDER_ROLE)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": "agent", "messages": MESSAGES, "provider": {"zdr": SECRET}},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "provider.zdr"
    assert SECRET not in response.text
    assert await sim_records(sim_url) == []


@pytest.mark.parametrize("bypass", ["models", "route", "transforms", "plugins"])
async def test_a_bypass_field_is_a_400_unless_the_role_allows_it(
    sim_server: SimFactory, proxy_server: ProxyFactory, bypass: str
) -> None:
    value: Any = "fallback" if bypass == "route" else [SECRET]
    body = {"model": "agent", "messages": MESSAGES, bypass: value}
    url, sim_url = await _proxy(sim_server, proxy_server, **ORDER_ROLE)
    async with httpx.AsyncClient() as client:
        refused = await client.post(f"{url}/v1/chat/completions", json=body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == (bypass, "field_not_allowed")
    assert error["message"].startswith(f"`{bypass}` would ")
    assert SECRET not in refused.text
    assert await sim_records(sim_url) == []

    url, sim_url = await _proxy(sim_server, proxy_server, callerMayBypass=[bypass], **ORDER_ROLE)
    async with httpx.AsyncClient() as client:
        allowed = await client.post(f"{url}/v1/chat/completions", json=body)
    assert allowed.status_code == 200
    (record,) = await sim_records(sim_url)
    assert record["route_fields"] == {bypass: value}  # passed through unchanged


async def test_a_direct_provider_s_machine_is_narrowed_by_name_too(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    machines = [{"name": "a1", "ttftSeconds": 0, "tokensPerSecond": 0}]
    sim = await sim_server(
        {
            "seed": 3,
            "models": [
                {"name": A, "reply": "one two three", "machines": machines},
                {"name": B, "reply": "one two three", "machines": [{"name": "b1"}]},
            ],
        }
    )
    proxy = await proxy_server(
        [
            provider_policy("direct", f"{sim.url}/v1", {A: ["a1"]}, dialect="OpenAI"),
            provider_policy("agg", f"{sim.url}/v1", {B: ["b1"]}),
            role_table(role("agent", [A, B])),
        ]
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "agent", "messages": MESSAGES, "provider": {"only": ["b1"]}},
        )
    assert response.status_code == 200
    assert response.headers["x-rolegate-machine"] == "b1"
    (record,) = await sim_records(sim.url)
    assert (record["model"], _sent(record)) == (
        B,
        {"order": ["b1"], "only": ["b1"], "allow_fallbacks": True},
    )
