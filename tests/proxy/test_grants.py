"""What grants give, through the real proxy, the simulator and the real `openai` client:
limits on requests, tokens and dollars (429 in OpenAI's shape with `Retry-After`, which the
client that waits as told gets through), a second grant's room used, admin rights by grant
or token only, role names told only to callers with a role, and each grant's use in
/metrics. The buckets' arithmetic on a moved clock: test_allowance.py."""

from __future__ import annotations

import math
from pathlib import Path
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
)

MODEL = "vendor/model-a"
PROMPT: Any = [{"role": "user", "content": "count to three"}]
ASK: dict[str, Any] = {"model": "agent", "messages": PROMPT}
CI_KEY = "sk-ci-caller-5b1e"
OPS_KEY = "sk-ops-caller-77d0"


async def _proxy(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    grants: list[dict[str, Any]],
    *,
    price: float | None = None,
    **settings: Any,
) -> Any:
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m"}]}]})
    policy = provider_policy("only", f"{sim.url}/v1", {MODEL: ["m"]}, dialect="OpenAI")
    if price is not None:
        policy["spec"]["models"][0]["machines"][0].update(
            {"priceInputPerMTok": price, "priceOutputPerMTok": price}
        )
    return await proxy_server(
        [policy, role_table(role("agent", [MODEL]), role("batch", [MODEL])), *grants],
        **settings,
    )


def _anyone(**limits: Any) -> dict[str, Any]:
    return access_grant("anyone", [{"anonymous": True}], ["agent"], limits=limits)


def _refusal(response: httpx.Response) -> tuple[dict[str, Any], int]:
    assert response.status_code == 429, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    return error, int(response.headers["Retry-After"])


async def test_over_requests_a_minute_429_says_when_to_retry_and_the_outcome_is_a_refusal(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, [_anyone(requestsPerMinute=2)])
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        answered = [await client.post("/v1/chat/completions", json=ASK) for _ in range(2)]
        refused = await client.post("/v1/chat/completions", json=ASK)
    assert [r.status_code for r in answered] == [200, 200]
    error, retry_after = _refusal(refused)
    # One request back every 30 s: the header says when, the message what to change.
    assert 29 <= retry_after <= 30
    assert error["type"] == "requests"
    assert "AccessGrant test/anyone allows 2 requests a minute" in error["message"]
    assert "spec.limits.requestsPerMinute" in error["message"]
    assert refused.headers["X-Rolegate-Role"] == "agent"
    found = await outcomes(proxy, 3)
    assert [o.grant for o in found] == ["test/anyone"] * 3
    # Refused by its own grant: the caller's doing, never an upstream's failure.
    assert (found[-1].status, found[-1].outcome.value) == (429, "rejected")
    assert not found[-1].arms


async def test_the_openai_client_waits_as_told_and_gets_through(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """60 a minute: one request back every second. A burst uses the bucket up; the real
    client, told `Retry-After: 1`, waits that long and its retry is admitted (the bucket
    refilled, as the header promised); without retries it raises RateLimitError."""
    proxy = await _proxy(sim_server, proxy_server, [_anyone(requestsPerMinute=60)])
    answered = 0
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        # Until the first refusal (a slow machine may see the bucket refill on the way).
        while (response := await client.post("/v1/chat/completions", json=ASK)).status_code == 200:
            answered += 1
            assert answered < 600
    assert answered >= 60
    assert response.headers["Retry-After"] == "1"
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0
    ) as impatient:
        with pytest.raises(openai.RateLimitError):
            await impatient.chat.completions.create(model="agent", messages=PROMPT)
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="unused", max_retries=2
    ) as patient:
        answer = await patient.chat.completions.create(model="agent", messages=PROMPT)
    assert answer.choices[0].message.content


async def test_tokens_a_minute_are_counted_from_usage_and_the_overdraft_is_waited_out(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, [_anyone(tokensPerMinute=5)])
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        first = await client.post("/v1/chat/completions", json=ASK)
        assert first.status_code == 200
        usage = first.json()["usage"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]
        assert used > 5  # one answer overdraws the bucket
        await outcomes(proxy, 1)  # charged when its outcome was emitted
        refused = await client.post("/v1/chat/completions", json=ASK)
    error, retry_after = _refusal(refused)
    assert error["type"] == "tokens"
    assert "5 tokens a minute" in error["message"]
    # The overdraft, refilled at 5 tokens a minute (less the moment that passed).
    assert retry_after == pytest.approx(math.ceil((used - 5) * 12), abs=1)


async def test_a_daily_budget_refuses_once_spent_and_says_when_it_is_back(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Priced at 1 USD a million tokens, one answer costs more than a budget of a
    hundred-thousandth of a dollar a day; the wait is the overdraft at a 24th an hour."""
    budget = 1e-5
    proxy = await _proxy(sim_server, proxy_server, [_anyone(costPerDayUSD=budget)], price=1.0)
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        assert (await client.post("/v1/chat/completions", json=ASK)).status_code == 200
        (served,) = await outcomes(proxy, 1)
        refused = await client.post("/v1/chat/completions", json=ASK)
    assert served.cost_usd is not None
    assert served.cost_usd > budget
    error, retry_after = _refusal(refused)
    assert error["type"] == "cost"
    assert "1e-05 USD a day" in error["message"]
    assert "spec.limits.costPerDayUSD" in error["message"]
    expected = (served.cost_usd - budget) / budget * 86_400
    assert retry_after == pytest.approx(expected, rel=0.01)


async def test_a_caller_with_two_grants_is_counted_against_the_one_with_room(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    """The CI job's key is in two grants for `batch`: its own (2 a minute) and a shared
    pool (1 a minute). Name order picks its own first; once that is spent, the pool;
    then 429 naming the grant that frees up first."""
    secrets = tmp_path / "secrets"
    (secrets / "ci").mkdir(parents=True)
    (secrets / "ci" / "key").write_text(CI_KEY)
    key = [{"apiKeySecretRef": {"name": "ci", "key": "key"}}]
    grants = [
        access_grant("a-ci", key, ["batch"], limits={"requestsPerMinute": 2}),
        access_grant("b-pool", key, ["batch"], limits={"requestsPerMinute": 1}),
    ]
    proxy = await _proxy(sim_server, proxy_server, grants, secrets_dir=secrets)
    ci = {"Authorization": f"Bearer {CI_KEY}"}
    batch = {**ASK, "model": "batch"}
    async with httpx.AsyncClient(base_url=proxy.url, headers=ci) as client:
        statuses = [
            (await client.post("/v1/chat/completions", json=batch)).status_code for _ in range(3)
        ]
        refused = await client.post("/v1/chat/completions", json=batch)
        wrong_role = await client.post("/v1/chat/completions", json=ASK)
    assert statuses == [200, 200, 200]
    error, retry_after = _refusal(refused)
    assert "AccessGrant test/a-ci" in error["message"]  # 30 s beats the pool's 60 s
    assert 29 <= retry_after <= 30
    # A role it lacks: the answer a role that does not exist gets (test_access_probing.py).
    assert wrong_role.status_code == 404
    assert [o.grant for o in await outcomes(proxy, 5)][:4] == [
        "test/a-ci", "test/a-ci", "test/b-pool", "test/a-ci"
    ]  # fmt: skip


async def test_admin_rights_come_from_a_grant_or_the_admin_token_and_nothing_else(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    for name, value in (("ci", CI_KEY), ("ops", OPS_KEY)):
        (secrets / name).mkdir(parents=True)
        (secrets / name / "key").write_text(value)
    grants = [
        access_grant("ci", [{"apiKeySecretRef": {"name": "ci", "key": "key"}}], ["agent"]),
        access_grant("ops", [{"apiKeySecretRef": {"name": "ops", "key": "key"}}], [], admin=True),
    ]
    proxy = await _proxy(
        sim_server, proxy_server, grants, secrets_dir=secrets, admin_token="admin-tok"
    )

    async def state(credential: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {credential}"} if credential else {}
        async with httpx.AsyncClient(base_url=proxy.url, headers=headers) as client:
            return await client.get("/v1/rolegate/state")

    assert (await state(OPS_KEY)).status_code == 200
    assert (await state("admin-tok")).status_code == 200
    caller = await state(CI_KEY)
    assert caller.status_code == 403
    assert caller.json()["error"]["code"] == "admin_not_granted"
    assert "This API key may not administer" in caller.json()["error"]["message"]
    assert "ci" not in caller.json()["error"]["message"]  # its Secret is never named
    assert (await state(None)).status_code == 401
    assert (await state("admin-to")).status_code == 401
    # An admin-only grant gives no role.
    async with httpx.AsyncClient(
        base_url=proxy.url, headers={"Authorization": f"Bearer {OPS_KEY}"}
    ) as client:
        assert (await client.post("/v1/chat/completions", json=ASK)).status_code == 403


async def test_each_grant_s_use_and_what_it_has_left_are_in_metrics(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, [_anyone(requestsPerMinute=2)], price=1.0)
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        for _ in range(3):
            await client.post("/v1/chat/completions", json=ASK)
        await outcomes(proxy, 3)
        page = (await client.get("/metrics")).text
    assert 'rolegate_grant_requests_total{grant="test/anyone",status="200"} 2.0' in page
    assert 'rolegate_grant_requests_total{grant="test/anyone",status="429"} 1.0' in page
    assert 'rolegate_grant_tokens_total{grant="test/anyone"}' in page
    assert 'rolegate_grant_cost_usd_total{grant="test/anyone"}' in page
    (left,) = [
        line
        for line in page.splitlines()
        if line.startswith('rolegate_grant_allowance_remaining_ratio{grant="test/anyone"')
    ]
    assert 'limit="requests"' in left
    assert 0 <= float(left.rsplit(" ", 1)[1]) < 0.1


async def test_which_roles_exist_is_told_only_to_callers_with_a_role(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    """An unknown caller learns no role name, from an error or from /v1/models; a known one
    learns only its own."""
    secrets = tmp_path / "secrets"
    (secrets / "ci").mkdir(parents=True)
    (secrets / "ci" / "key").write_text(CI_KEY)
    ci = access_grant("ci", [{"apiKeySecretRef": {"name": "ci", "key": "key"}}], ["batch"])
    proxy = await _proxy(sim_server, proxy_server, [ci], secrets_dir=secrets)
    typo = {**ASK, "model": "bacth"}
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        for headers in ({}, {"Authorization": "Bearer sk-nobody"}):
            for response in (
                await client.post("/v1/chat/completions", json=typo, headers=headers),
                await client.get("/v1/models", headers=headers),
            ):
                assert response.status_code == 401
                assert "batch" not in response.text
                assert "agent" not in response.text
        known = {"Authorization": f"Bearer {CI_KEY}"}
        unknown_role = await client.post("/v1/chat/completions", json=typo, headers=known)
        models = await client.get("/v1/models", headers=known)
    assert unknown_role.status_code == 404
    assert "Your roles: batch." in unknown_role.json()["error"]["message"]
    assert "agent" not in unknown_role.text
    assert [model["id"] for model in models.json()["data"]] == ["batch"]
