"""Quality that learns, through the real proxy and simulator (SPEC C1-C6, C8).

The operational score closes the loop by itself (outcome, then score, then the next
decision, no export involved); the semantic score stays null until an evaluator reports on
`POST /v1/feedback`, and then moves only for the machine that served the judged request.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx
import openai
import pytest

from ..support import (
    ProxyFactory,
    SimFactory,
    access_grant,
    outcomes,
    provider_policy,
    role,
    role_table,
    sim_records,
)
from ..waiting import eventually

MODEL = "vendor/model-a"
OTHER = "vendor/model-b"
TOKEN = "admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ASK: dict[str, Any] = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}


def _direct(name: str, url: str, *, price: float, **spec: Any) -> dict[str, Any]:
    """A plain OpenAI-compatible provider: one machine (named like the provider)."""
    policy = provider_policy(name, f"{url}/v1", {MODEL: [name]}, dialect="OpenAI", **spec)
    policy["spec"]["models"][0]["machines"][0].update(
        {"priceInputPerMTok": price, "priceOutputPerMTok": price}
    )
    return policy


def _agent(tolerance: float = 0.05) -> dict[str, Any]:
    # One attempt per provider: a failure moves straight to the other provider, so which
    # provider a request went to first is the score's doing alone.
    return role_table(
        {
            **role("agent", [MODEL], patience=30),
            "qualityTolerance": tolerance,
            "retry": {"attemptsPerModel": 1},
        }
    )


async def _two_providers(
    sim_server: SimFactory, proxy_server: ProxyFactory, **settings: Any
) -> tuple[str, str, str]:
    cheap = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    dear = await sim_server({"seed": 2, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    proxy = await proxy_server(
        [
            _direct("cheap", cheap.url, price=1),
            _direct("dear", dear.url, price=2),
            _agent(),
            CALLERS,
        ],
        **settings,
    )
    return proxy.url, cheap.url, dear.url


# Anyone may ask; only the admin token (or an admin grant) may judge or read the state.
CALLERS = access_grant("callers", [{"anonymous": True}], ["*"])


async def _ask(client: httpx.AsyncClient, url: str, request_id: str) -> httpx.Response:
    response = await client.post(
        f"{url}/v1/chat/completions", json=ASK, headers={"X-Request-Id": request_id}
    )
    assert response.status_code == 200, response.text
    return response


async def _state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/v1/rolegate/state", headers=ADMIN)
    assert response.status_code == 200
    state: dict[str, Any] = response.json()
    return state


def _score(state: dict[str, Any], machine: str) -> dict[str, Any]:
    (row,) = [row for row in state["scores"] if row["machine"] == machine]
    return dict(row)


async def test_cold_machines_show_neutral_and_no_semantic_score(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _, _ = await _two_providers(sim_server, proxy_server, admin_token=TOKEN)
    async with httpx.AsyncClient() as client:
        state = await _state(client, url)
    for machine in ("cheap", "dear"):
        row = _score(state, machine)
        assert row["operational"] == {
            "score": 0.5,
            "observed": None,
            "n": 0,
            "confidence": 0.0,
            "neutral": 0.5,
        }
        assert row["semantic"] is None
    assert state["outcomes"]["emitted"] == 0


async def test_feedback_moves_only_the_semantic_score_of_the_machine_that_served(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy_url, _, _ = await _two_providers(sim_server, proxy_server, admin_token=TOKEN)
    async with httpx.AsyncClient() as client:
        served = await _ask(client, proxy_url, "req-1")
        machine = served.headers["x-rolegate-machine"]
        assert machine == "cheap"  # both cold: quality ties, the cheaper leads
        await outcomes_for(client, proxy_url, 1)
        before = await _state(client, proxy_url)
        judged = await client.post(
            f"{proxy_url}/v1/feedback",
            headers=ADMIN,
            json={"request_id": "req-1", "score": 2, "scale": [1, 5], "evaluator": "judge-a"},
        )
        assert judged.status_code == 202, judged.text
        body = judged.json()
        assert (body["provider"], body["machine"]) == ("cheap", "cheap")
        after = await _state(client, proxy_url)
    cheap_before, cheap_after = _score(before, "cheap"), _score(after, "cheap")
    # Operational untouched; semantic now one judgment: 2 on 1..5 is 0.25, shrunk by 1/50.
    assert cheap_after["operational"] == cheap_before["operational"]
    assert cheap_after["semantic"]["n"] == 1
    assert cheap_after["semantic"]["observed"] == pytest.approx(0.25)
    assert cheap_after["semantic"]["score"] == pytest.approx(0.5 + (0.25 - 0.5) / 50)
    assert cheap_after["semantic_scale"] == [1, 5]
    assert cheap_after["evaluators"] == {"judge-a": 1}
    # The other machine: nothing moved, its semantic score is still absent.
    assert _score(after, "dear") == _score(before, "dear")
    assert _score(after, "dear")["semantic"] is None


async def outcomes_for(client: httpx.AsyncClient, url: str, count: int) -> None:
    """Wait until `count` outcomes reached the decision log (the channel drains on the
    loop's next turn after the response)."""

    async def enough() -> bool:
        found = (await client.get(f"{url}/v1/rolegate/decisions", headers=ADMIN)).json()
        return len(found["decisions"]) >= count

    await eventually(enough, what=f"{count} outcomes in the decision log")


@pytest.mark.parametrize(
    ("headers", "body", "status", "code", "param"),
    [
        ({}, {"request_id": "req-1", "score": 1, "evaluator": "j"}, 401,
         "invalid_api_key", None),
        ({"Authorization": "Bearer wrong"}, {"request_id": "req-1", "score": 1,
                                             "evaluator": "j"}, 401, "invalid_api_key", None),
        (ADMIN, {"request_id": "nope", "score": 1, "evaluator": "j"}, 404, "unknown_request",
         "request_id"),
        (ADMIN, {"request_id": "req-1", "score": 7, "scale": [1, 5], "evaluator": "j"}, 400,
         "invalid_request", "score"),
        (ADMIN, {"request_id": "req-1", "score": 1, "scale": [5, 1], "evaluator": "j"}, 400,
         "invalid_request", "scale"),
        (ADMIN, {"request_id": "req-1", "score": True, "evaluator": "j"}, 400, "invalid_request",
         "score"),
        (ADMIN, {"request_id": "req-1", "score": 1, "evaluator": ""}, 400, "invalid_request",
         "evaluator"),
        (ADMIN, {"request_id": "req-1", "score": 1, "evaluator": "j", "prompt": "x"}, 400,
         "invalid_request", "prompt"),
        (ADMIN, ["not", "an", "object"], 400, "invalid_request", None),
    ],
)  # fmt: skip
async def test_bad_feedback_is_refused_with_what_to_fix_and_moves_nothing(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    headers: dict[str, str],
    body: Any,
    status: int,
    code: str,
    param: str | None,
) -> None:
    url, _, _ = await _two_providers(sim_server, proxy_server, admin_token=TOKEN)
    async with httpx.AsyncClient() as client:
        await _ask(client, url, "req-1")
        await outcomes_for(client, url, 1)
        response = await client.post(f"{url}/v1/feedback", headers=headers, json=body)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == code
        assert error["param"] == param
        assert error["message"]
        state = await _state(client, url)
    assert all(row["semantic"] is None for row in state["scores"])


async def test_an_evaluator_judges_a_request_once_and_a_failed_request_not_at_all(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    down = [{"kind": "serverError", "always": True, "status": 503}]
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [
        {"name": "m", "faults": down}]}]})  # fmt: skip
    ok = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    proxy = await proxy_server(
        [_direct("only", sim.url, price=1), _direct("fine", ok.url, price=2), _agent()],
        admin_token=TOKEN,
    )
    async with httpx.AsyncClient() as client:
        served = await _ask(client, proxy.url, "req-ok")
        assert served.headers["x-rolegate-machine"] == "fine"
        await outcomes_for(client, proxy.url, 1)
        judgment = {"request_id": "req-ok", "score": 1, "evaluator": "judge-a"}
        first = await client.post(f"{proxy.url}/v1/feedback", headers=ADMIN, json=judgment)
        again = await client.post(f"{proxy.url}/v1/feedback", headers=ADMIN, json=judgment)
        other = await client.post(
            f"{proxy.url}/v1/feedback", headers=ADMIN, json={**judgment, "evaluator": "judge-b"}
        )
    assert first.status_code == 202
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "already_judged"
    assert other.status_code == 202
    # A request nobody answered has nothing to judge.
    proxy2 = await proxy_server([_direct("only", sim.url, price=1), _agent()], admin_token=TOKEN)
    async with httpx.AsyncClient() as client:
        failed = await client.post(
            f"{proxy2.url}/v1/chat/completions", json=ASK, headers={"X-Request-Id": "req-bad"}
        )
        assert failed.status_code == 502
        await outcomes_for_proxy(proxy2.url, client)
        refused = await client.post(
            f"{proxy2.url}/v1/feedback",
            headers=ADMIN,
            json={"request_id": "req-bad", "score": 0, "evaluator": "judge-a"},
        )
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "not_answered"


async def outcomes_for_proxy(url: str, client: httpx.AsyncClient) -> None:
    await outcomes_for(client, url, 1)


async def test_without_admin_rights_feedback_and_state_are_refused(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """No admin token and no admin grant: the admin endpoints are closed (never open by
    default), and the refusal says both ways in."""
    url, _, _ = await _two_providers(sim_server, proxy_server)
    async with httpx.AsyncClient() as client:
        await _ask(client, url, "req-1")
        refused = [
            await client.post(
                f"{url}/v1/feedback", json={"request_id": "req-1", "score": 1, "evaluator": "j"}
            ),
            await client.get(f"{url}/v1/rolegate/state"),
            await client.get(f"{url}/v1/rolegate/decisions"),
        ]
    for response in refused:
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert "--admin-token-file" in error["message"]
        assert "admin: true" in error["message"]


# Keeps the breaker out of the way: these tests are about the score (slow drift), not trips.
LENIENT = {"novelSignatureCount": 10_000, "familiarSignatureCount": 10_000, "rateThreshold": 1}

FLAKY = [{"kind": "serverError", "probability": 0.5, "status": 503}]


async def _routing_run(
    sim_server: SimFactory, proxy_server: ProxyFactory, **settings: Any
) -> list[tuple[str | None, str]]:
    """60 requests against a flaky cheap provider and a steady dear one, with a seeded
    proxy: which provider each request was sent to first, and which answered."""
    cheap = await sim_server({"seed": 7, "models": [{"name": MODEL, "machines": [
        {"name": "m", "faults": FLAKY}]}]})  # fmt: skip
    dear = await sim_server({"seed": 7, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    lenient = {"breaker": LENIENT}
    proxy = await proxy_server(
        [
            _direct("cheap", cheap.url, price=1, **lenient),
            _direct("dear", dear.url, price=2, **lenient),
            _agent(tolerance=0.1),
        ],
        random_seed=11,
        **settings,
    )
    async with httpx.AsyncClient() as client:
        for i in range(60):
            await _ask(client, proxy.url, f"req-{i}")
    found = await outcomes(proxy, 60)
    return [(o.arms[0].provider, o.provider or "") for o in found]


async def test_without_an_evaluator_routing_is_identical_to_feedback_disabled(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    enabled = await _routing_run(sim_server, proxy_server, admin_token=TOKEN)
    disabled = await _routing_run(sim_server, proxy_server)
    assert enabled == disabled
    # And the run was not trivial: both providers were sent to first at some point.
    assert {first for first, _ in enabled} == {"cheap", "dear"}


async def _failing_cheap_run(
    sim_server: SimFactory, proxy_server: ProxyFactory, tolerance: float, explore: float
) -> tuple[list[str], str, str]:
    """300 requests through the openai client while the cheap provider answers 503 a
    quarter of the time (each failure is retried on the dear one, so callers never
    notice): which provider each request was sent to first, and the proxy's and the dear
    simulator's URLs."""
    failing = [{"kind": "serverError", "probability": 0.25, "status": 503}]
    cheap = await sim_server({"seed": 3, "models": [{"name": MODEL, "machines": [
        {"name": "m", "faults": failing}]}]})  # fmt: skip
    dear = await sim_server({"seed": 3, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    proxy = await proxy_server(
        [
            _direct("cheap", cheap.url, price=1, breaker=LENIENT),
            _direct("dear", dear.url, price=2, breaker=LENIENT),
            _agent(tolerance=tolerance),
        ],
        random_seed=5,
        explore_share=explore,
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as client:
        for _ in range(300):
            answer = await client.chat.completions.create(model="agent", messages=ASK["messages"])
            assert answer.choices[0].message.content  # callers always get an answer
    firsts = [o.arms[0].provider for o in await outcomes(proxy, 300)]
    assert len(await sim_records(cheap.url)) == firsts.count("cheap")
    return firsts, proxy.url, dear.url


async def test_closed_loop_a_failing_machine_loses_traffic_gradually_and_another_gains_it(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Outcome, score, next decision, with no export involved: the cheap provider's
    operational score drifts down as its failures accumulate, the dear one's few answers
    (from the retries) count at once (both are shrunk towards their field's mean, not
    towards 0.5), and the cheap one's share of first attempts fades over several windows —
    the dithered quality tiers of a 0.3 tolerance — instead of flipping at one request, down
    to a share that reflects how far behind it is, never to nothing."""
    firsts, proxy_url, dear_url = await _failing_cheap_run(
        sim_server, proxy_server, tolerance=0.3, explore=0.02
    )
    windows = [firsts[i : i + 20].count("cheap") / 20 for i in range(0, 300, 20)]
    print(f"\ncheap provider's share of first attempts per 20 requests: {windows}")
    early, middle, late = windows[:5], windows[5:10], windows[10:]
    mean = statistics.fmean
    # While little is known it leads most first attempts (quality ties inside the
    # tolerance: the cheaper leads; about nine in ten while the dear one's few answers are
    # all it has to show).
    assert windows[0] >= 0.75
    # Then it fades over several windows, not at one request ...
    assert sum(1 for share in windows if 0.1 < share < 0.9) >= 3
    assert mean(early) > mean(middle) > mean(late)
    # ... to well behind (about 1 - 0.25/0.3 of first attempts at its true rate), but never
    # shut out: exploration keeps it observed, so it could win its traffic back.
    assert mean(late) <= 0.35
    assert "cheap" in firsts[-100:]
    # Soft, never excluded: when the steady one fails, the demoted one still answers.
    async with httpx.AsyncClient() as client:
        broken = [{"kind": "serverError", "always": True, "status": 503}]
        put = await client.put(f"{dear_url}/_sim/machines/{MODEL}/m/faults", json=broken)
        assert put.status_code == 200
        response = await _ask(client, proxy_url, "after")
    assert response.headers["x-rolegate-provider"] == "cheap"


async def test_closed_loop_control_without_a_tolerance_the_traffic_flips_at_once(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The same run with a tolerance of 0 and no exploration (strict tiers, no dither):
    the lead changes hands at one request and never comes back, which is what the dither
    and the exploration avoid."""
    firsts, _, _ = await _failing_cheap_run(sim_server, proxy_server, tolerance=0.0, explore=0.0)
    switch = firsts.index("dear")
    assert switch > 0
    assert firsts[:switch] == ["cheap"] * switch
    assert firsts[switch:] == ["dear"] * (300 - switch)


async def test_mangled_answers_never_enter_the_operational_score(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """SPEC A5: a mangled answer is the breaker's business, never the score's, whether it
    was caught before the client saw it (not streamed: the next machine served) or
    delivered (streamed, its only machine). The machine that answered clean is scored."""
    mangling = {"name": "m1", "faults": [{"kind": "mojibake", "always": True}]}
    sim = await sim_server(
        {"seed": 1, "models": [
            {"name": MODEL, "reply": "It\u2019s done \u2014 caf\u00e9", "machines": [
                mangling, {"name": "m2"}]},
            {"name": OTHER, "reply": "It\u2019s done \u2014 caf\u00e9", "machines": [mangling]},
        ]}
    )  # fmt: skip
    # m1 leads on the sheet, so the backed role tries it first.
    sheets = [
        {"name": "m1", "ttftSeconds": 0.05, "tokensPerSecond": 200},
        {"name": "m2", "ttftSeconds": 0.1, "tokensPerSecond": 100},
    ]
    policy = provider_policy("agg", f"{sim.url}/v1", {MODEL: [], OTHER: ["m1"]})
    policy["spec"]["models"][0]["machines"] = sheets
    proxy = await proxy_server(
        [policy, role_table(role("backed", [MODEL]), role("alone", [OTHER]))],
        admin_token=TOKEN,
    )
    ascii_prompt: Any = [{"role": "user", "content": "say it"}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as api:
        backed = await api.chat.completions.create(model="backed", messages=ascii_prompt)
        assert backed.choices[0].message.content == "It\u2019s done \u2014 caf\u00e9"
        chunks = await api.chat.completions.create(
            model="alone", messages=ascii_prompt, stream=True
        )
        delivered = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        assert delivered != "It\u2019s done \u2014 caf\u00e9"  # the mangled text, delivered

    records = await outcomes(proxy, 2)
    assert [[(arm.machine, arm.result.value) for arm in r.arms] for r in records] == [
        [("m1", "degraded"), ("m2", "ok")],
        [("m1", "degraded")],
    ]
    async with httpx.AsyncClient() as client:

        async def scored() -> dict[str, Any] | None:
            state = await _state(client, proxy.url)
            return (
                state
                if state["outcomes"]["emitted"] == 2
                and any(
                    row["machine"] == "m2" and row["operational"]["n"] == 1
                    for row in state["scores"]
                )
                else None
            )

        state = await eventually(scored, what="the clean answer scored")
    observed = {(row["model"], row["machine"]): row["operational"]["n"] for row in state["scores"]}
    assert observed == {(MODEL, "m1"): 0, (MODEL, "m2"): 1, (OTHER, "m1"): 0}
