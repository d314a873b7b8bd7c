"""The canary (SPEC C8, E1): distinctive strings placed in prompts, completions and API keys
never appear in any explanation, metric, log line or outcome export.

Traffic covers the paths that produce routing metadata: a streamed and a plain answer, a
failure on one machine retried on the other, an empty answer on 200, a mangled answer, a
request nobody could serve, a client that left mid-stream, bad input, and feedback. Then
every surface is read and searched for the canaries. The same run checks the key did
reach the provider (so the search is meaningful) and the completion reached the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..support import ProxyFactory, SimFactory, outcomes, role, role_table

MODEL = "vendor/model-a"
PROMPT_CANARY = "canary-prompt-7f3a9c"
COMPLETION_CANARY = "canary-completion-b41e"
KEY_CANARY = "sk-canary-key-e9d2"
CANARIES = (PROMPT_CANARY, COMPLETION_CANARY, KEY_CANARY)
TOKEN = "admin-token-canary"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MESSAGES: Any = [
    {"role": "system", "content": f"You are {PROMPT_CANARY}."},
    {"role": "user", "content": f"Repeat {PROMPT_CANARY} please — café"},
]


async def _faults(client: httpx.AsyncClient, sim_url: str, machine: str, faults: Any) -> None:
    response = await client.put(f"{sim_url}/_sim/machines/{MODEL}/{machine}/faults", json=faults)
    assert response.status_code == 200


def _policy(url: str) -> dict[str, Any]:
    # `good` is the faster on the sheet, so it leads while both are cold.
    machines = [
        {"name": "good", "ttftSeconds": 0.05, "tokensPerSecond": 200},
        {"name": "backup", "ttftSeconds": 0.1, "tokensPerSecond": 100},
    ]
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "agg", "namespace": "test"},
        "spec": {
            "endpoint": f"{url}/v1",
            "dialect": "Aggregator",
            "apiKeySecretRef": {"name": "agg-key", "key": "apiKey"},
            "models": [{"name": MODEL, "machines": machines}],
        },
    }


async def test_no_prompt_completion_or_key_leaks_into_any_surface(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets = tmp_path / "secrets"
    (secrets / "agg-key").mkdir(parents=True)
    (secrets / "agg-key" / "apiKey").write_text(KEY_CANARY + "\n")
    export = tmp_path / "outcomes.jsonl"
    reply = f"Here it is: {COMPLETION_CANARY} — done."
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "good"}, {"name": "backup"}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [_policy(sim.url), role_table(role("agent", [MODEL], patience=20))],
        secrets_dir=secrets,
        outcome_export=str(export),
        admin_token=TOKEN,
    )
    sent = 0
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        answer = await ai.chat.completions.create(model="agent", messages=MESSAGES)
        assert COMPLETION_CANARY in (answer.choices[0].message.content or "")
        stream = await ai.chat.completions.create(model="agent", messages=MESSAGES, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert COMPLETION_CANARY in text
        sent += 2
    async with httpx.AsyncClient(timeout=10) as client:
        url = f"{proxy.url}/v1/chat/completions"
        # Each fault on the leading machine in turn (the backup answers), then on both.
        faults = [
            [{"kind": "serverError", "always": True, "status": 503, "message": "overloaded"}],
            [{"kind": "empty", "always": True}],
            [{"kind": "mojibake", "always": True}],
        ]
        for fault in faults:
            await _faults(client, sim.url, "good", fault)
            await _faults(client, sim.url, "backup", [])
            answered = await client.post(url, json={"model": "agent", "messages": MESSAGES})
            assert answered.status_code == 200
            sent += 1
        await _faults(client, sim.url, "good", faults[0])
        await _faults(client, sim.url, "backup", faults[0])
        failed = await client.post(url, json={"model": "agent", "messages": MESSAGES})
        assert failed.status_code == 502
        sent += 1
        await _faults(client, sim.url, "good", [])
        await _faults(client, sim.url, "backup", [])
        # Bad input that carries the canary in its messages.
        bad = await client.post(url, json={"model": "agent", "messages": MESSAGES, "stream": 1})
        assert bad.status_code == 400
        sent += 1
        # A client that leaves mid-stream.
        slow = {"model": "agent", "messages": MESSAGES, "stream": True}
        async with client.stream("POST", url, json=slow) as response:
            async for _ in response.aiter_bytes():
                break
        sent += 1
        await outcomes(proxy, sent)
        # Feedback on the first request.
        decisions = (await client.get(f"{proxy.url}/v1/rolegate/decisions", headers=ADMIN)).json()
        first = decisions["decisions"][0]["request_id"]
        judged = await client.post(
            f"{proxy.url}/v1/feedback",
            headers=ADMIN,
            json={"request_id": first, "score": 0.9, "evaluator": "judge-a"},
        )
        assert judged.status_code == 202
        surfaces = {
            "decisions": (
                await client.get(f"{proxy.url}/v1/rolegate/decisions", headers=ADMIN)
            ).text,
            "state": (await client.get(f"{proxy.url}/v1/rolegate/state", headers=ADMIN)).text,
            "metrics": (await client.get(f"{proxy.url}/metrics")).text,
            "models": (await client.get(f"{proxy.url}/v1/models")).text,
            "readyz": (await client.get(f"{proxy.url}/readyz")).text,
            "bad-input error": bad.text,
            "failure error": failed.text,
        }
        # The key did reach the provider, so its absence elsewhere means something.
        records = (await client.get(f"{sim.url}/_sim/requests")).json()
    fingerprint = hashlib.sha256(KEY_CANARY.encode()).hexdigest()[:12]
    assert {record["bearer_sha256"] for record in records} == {fingerprint}
    await proxy.stop()  # flushes the exporter
    await asyncio.sleep(0)
    surfaces["export"] = export.read_text(encoding="utf-8")
    assert surfaces["export"].count("\n") == sent
    surfaces["logs"] = "\n".join(
        f"{record.name} {record.getMessage()} {record.exc_text or ''}"
        for record in caplog.records
        if not record.name.startswith("rolegate.sim")
    )
    for surface, text in surfaces.items():
        for canary in CANARIES:
            assert canary not in text, f"{canary} leaked into {surface}"
    assert "agent" in surfaces["decisions"]  # the surfaces were not empty
