"""OpenRouter-style routing by the body's `provider` object, against the real server."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from rolegate_sim.routing import ProviderPreferences, preference_list

from .simclient import MODEL, StartSim, body, chat, machine, records, scenario

DOWN = {"kind": "down", "always": True}
THREE = scenario(machine("a"), machine("b"), machine("c"))


@pytest.mark.parametrize(
    ("provider", "served_by"),
    [
        (None, "a"),
        ({"order": ["b", "c"]}, "b"),
        ({"order": ["nonexistent", "c"]}, "c"),
        ({"only": ["c"]}, "c"),
        ({"only": ["b", "c"], "order": ["c"]}, "c"),
        ({"ignore": ["a"]}, "b"),
        ({"ignore": ["b"], "order": ["b", "c"]}, "c"),
        ({"order": ["b"], "allow_fallbacks": False}, "b"),
        # OpenRouter ignores provider fields it does not route on here.
        ({"order": ["c"], "sort": "price", "data_collection": "deny"}, "c"),
    ],
)
async def test_the_provider_object_picks_the_machine(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    provider: dict[str, Any] | None,
    served_by: str,
) -> None:
    sim = await start_sim(THREE)
    extra = {} if provider is None else {"provider": provider}
    for stream in (False, True):
        reply = await chat(http, sim.url, body(stream=stream, **extra))
        assert reply.status == 200
        served = reply.chunks if stream else [reply.json()]
        assert {c["provider"] for c in served} == {served_by}
    record = (await records(http, sim.url))[-1]
    assert record["machine"] == served_by


async def test_fallback_serves_from_a_machine_the_caller_never_named(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), machine("b", DOWN), machine("c")))
    reply = await chat(http, sim.url, body(provider={"order": ["b"]}))
    assert reply.status == 200
    assert reply.json()["provider"] == "a"
    (record,) = await records(http, sim.url)
    assert record["skipped_down"] == ["b"]
    assert record["machine"] == "a"


async def test_without_fallbacks_a_down_machine_means_no_endpoint(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), machine("b", DOWN)))
    reply = await chat(http, sim.url, body(provider={"order": ["b"], "allow_fallbacks": False}))
    assert reply.status == 404
    error = reply.json()["error"]
    assert error["message"] == (
        f"No endpoints found for {MODEL} matching your provider preferences"
    )
    assert error["code"] == 404
    assert "provider" not in reply.json()  # no machine served
    (record,) = await records(http, sim.url)
    assert record["machine"] is None
    assert record["outcome"] == "error_status"
    assert record["status"] == 404


async def test_without_fallbacks_every_ordered_machine_is_still_tried(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), machine("b", DOWN), machine("c")))
    provider = {"order": ["b", "c"], "allow_fallbacks": False}
    assert (await chat(http, sim.url, body(provider=provider))).json()["provider"] == "c"


async def test_without_order_and_fallbacks_only_the_primary_is_tried(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", DOWN), machine("b")))
    reply = await chat(http, sim.url, body(provider={"allow_fallbacks": False}))
    assert reply.status == 404
    reply = await chat(http, sim.url, body(provider={"allow_fallbacks": True}))
    assert reply.json()["provider"] == "b"


async def test_only_and_ignore_can_leave_nothing(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(THREE)
    for provider in (
        {"only": ["zzz"]},
        {"ignore": ["a", "b", "c"]},
        {"only": ["a"], "ignore": ["a"]},
    ):
        reply = await chat(http, sim.url, body(provider=provider))
        assert reply.status == 404, provider
        assert "No endpoints found" in reply.json()["error"]["message"]


async def test_all_machines_down_is_no_endpoint(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", DOWN), machine("b", DOWN)))
    reply = await chat(http, sim.url, body(stream=True))
    assert reply.status == 404
    (record,) = await records(http, sim.url)
    assert record["skipped_down"] == ["a", "b"]


async def test_a_scheduled_down_counts_requests_per_machine(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a", {"kind": "down", "schedule": [1, 3]}), machine("b"))
    )
    served = [(await chat(http, sim.url, body())).json()["provider"] for _ in range(4)]
    assert served == ["b", "a", "b", "a"]


async def test_the_record_keeps_the_provider_object_as_received(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(THREE)
    await chat(http, sim.url, body(provider={"order": ["b"], "allow_fallbacks": False}))
    await chat(http, sim.url, body())
    with_provider, without = await records(http, sim.url)
    assert with_provider["provider"] == {
        "order": ["b"],
        "only": None,
        "ignore": None,
        "allow_fallbacks": False,
    }
    assert without["provider"] is None


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "`model` is required"),
        (b'{"model": "vendor/model-a", "messages": []}', "`messages` is required"),
        (b'{"model": "vendor/model-a", "messages": ["hi"]}', "`messages[0]`"),
        (
            b'{"model": "vendor/model-a", "messages": [{"role": "user"}], "stream": "yes"}',
            "`stream` must be a boolean",
        ),
        (
            b'{"model": "vendor/model-a", "messages": [{"role": "user"}], "max_tokens": 0}',
            "`max_tokens` must be a positive integer",
        ),
        (
            b'{"model": "vendor/model-a", "messages": [{"role": "user"}], '
            b'"provider": {"order": "a"}}',
            "`provider.order` must be a list",
        ),
        (
            b'{"model": "vendor/model-a", "messages": [{"role": "user"}], '
            b'"provider": {"allow_fallbacks": "no"}}',
            "`provider.allow_fallbacks` must be a boolean",
        ),
    ],
)
async def test_invalid_bodies_are_400(
    start_sim: StartSim, http: aiohttp.ClientSession, payload: bytes, says: str
) -> None:
    sim = await start_sim(THREE)
    reply = await chat(http, sim.url, payload)
    assert reply.status == 400
    assert reply.headers["Content-Type"] == "application/json"
    error = reply.json()["error"]
    assert says in error["message"]
    assert error["type"] == "invalid_request_error"
    (record,) = await records(http, sim.url)
    assert (record["outcome"], record["status"]) == ("error_status", 400)


async def test_an_unknown_model_is_404(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(THREE)
    reply = await chat(http, sim.url, {**body(), "model": "nobody/none"})
    assert reply.status == 404
    assert "nobody/none" in reply.json()["error"]["message"]
    (record,) = await records(http, sim.url)
    assert record["model"] == "nobody/none"
    assert record["machine"] is None


@pytest.mark.parametrize(
    ("prefs", "expected"),
    [
        (ProviderPreferences(), ["a", "b", "c"]),
        (ProviderPreferences(order=("c", "c", "a")), ["c", "a", "b"]),
        (ProviderPreferences(order=("c",), allow_fallbacks=False), ["c"]),
        (ProviderPreferences(order=(), allow_fallbacks=False), []),
        (ProviderPreferences(only=("b", "a")), ["a", "b"]),
        (ProviderPreferences(ignore=("a",), allow_fallbacks=False), ["b"]),
        (ProviderPreferences(order=("a", "b"), ignore=("a",)), ["b", "c"]),
    ],
)
def test_preference_list(prefs: ProviderPreferences, expected: list[str]) -> None:
    assert preference_list(("a", "b", "c"), prefs) == expected


async def test_the_record_shows_every_provider_field_and_route_field_as_it_came(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(THREE)
    provider = {"only": ["b"], "data_collection": "deny", "zdr": True, "quantizations": ["fp8"]}
    plugins = [{"id": "web"}]
    reply = await chat(http, sim.url, body(provider=provider, plugins=plugins, models=["x/y"]))
    assert reply.status == 200
    reply = await chat(http, sim.url, body())
    assert reply.status == 200
    first, second = await records(http, sim.url)
    assert first["provider"] == {
        "order": None, "only": ["b"], "ignore": None, "allow_fallbacks": None,
        "data_collection": "deny", "zdr": True, "quantizations": ["fp8"],
    }  # fmt: skip
    assert first["route_fields"] == {"models": ["x/y"], "plugins": plugins}
    assert (second["provider"], second["route_fields"]) == (None, None)
