"""The canary (SPEC C8, E1): distinctive strings placed in prompts, completions and API keys
never appear in any explanation, metric, log line, outcome export or trace span.

Traffic covers the paths that produce routing metadata: a streamed and a plain answer, a
failure on one machine retried on the other, an empty answer on 200, a mangled answer, a
request nobody could serve, a client that left mid-stream, bad input, and feedback. Then
every surface is read and searched for the canaries. The same run checks the key did
reach the provider (so the search is meaningful) and the completion reached the client.

Upstream errors whose text carries the canaries (SPEC A4, C8, E6): a 503, a 401 that
echoes the key, a 429, an error event mid-stream (and one before any content) and a 400
that quotes the prompt, each also with an error canary in its text (and in a `code` or
`type` that is not one of the known set). The simulator is checked to have sent that text;
the client's error (through the `openai` client and raw) must say what happened in our
words with the upstream's status and known code, and no surface may carry any of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rolegate_proxy.edge.tracing import TraceSettings

from ..support import ProxyFactory, SimFactory, outcomes, role, role_table

MODEL = "vendor/model-a"
PROMPT_CANARY = "canary-prompt-7f3a9c"
COMPLETION_CANARY = "canary-completion-b41e"
KEY_CANARY = "sk-canary-key-e9d2"
ERROR_CANARY = "canary-upstream-error-5c1d"
CANARIES = (PROMPT_CANARY, COMPLETION_CANARY, KEY_CANARY, ERROR_CANARY)
# What an upstream's error text carries in the error cases.
ERROR_TEXT_CANARIES = (ERROR_CANARY, PROMPT_CANARY, KEY_CANARY)
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


def _secrets(tmp_path: Path) -> Path:
    """The provider's API key, the key canary, as a mounted Secret."""
    secrets = tmp_path / "secrets"
    (secrets / "agg-key").mkdir(parents=True)
    (secrets / "agg-key" / "apiKey").write_text(KEY_CANARY + "\n")
    return secrets


async def _read_surfaces(client: httpx.AsyncClient, proxy_url: str) -> dict[str, str]:
    """What the proxy serves about its routing: explanations, state and metrics."""
    return {
        "decisions": (await client.get(f"{proxy_url}/v1/rolegate/decisions", headers=ADMIN)).text,
        "state": (await client.get(f"{proxy_url}/v1/rolegate/state", headers=ADMIN)).text,
        "metrics": (await client.get(f"{proxy_url}/metrics")).text,
    }


def _logs(caplog: pytest.LogCaptureFixture) -> str:
    """Every log record but the simulator's (it is the upstream, not us)."""
    return "\n".join(
        f"{record.name} {record.getMessage()} {record.exc_text or ''}"
        for record in caplog.records
        if not record.name.startswith("rolegate.sim")
    )


def _spans(exporter: InMemorySpanExporter, requests: int) -> str:
    """Every exported span, whole (names, attributes, events, status, resource), once each
    of `requests` has its request span (the proxy has stopped: its export is flushed)."""
    spans = exporter.get_finished_spans()
    assert sum(1 for s in spans if s.parent is None) == requests
    return "\n".join(span.to_json() for span in spans)


def _assert_no_canary(surfaces: dict[str, str]) -> None:
    for surface, text in surfaces.items():
        for canary in CANARIES:
            assert canary not in text, f"{canary} leaked into {surface}"


async def test_no_prompt_completion_or_key_leaks_into_any_surface(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets = _secrets(tmp_path)
    export = tmp_path / "outcomes.jsonl"
    spans = InMemorySpanExporter()
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
        tracing=TraceSettings(spans, delay_seconds=0.01),
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
            **await _read_surfaces(client, proxy.url),
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
    surfaces["spans"] = _spans(spans, sent)
    surfaces["logs"] = _logs(caplog)
    _assert_no_canary(surfaces)
    assert "agent" in surfaces["decisions"]  # the surfaces were not empty


# --- upstream errors whose text carries the canaries -------------------------------------


@dataclass(frozen=True, slots=True)
class UpstreamError:
    """A fault both machines answer with, and what the client must be told of it."""

    fault: dict[str, Any]
    stream: bool
    # The client's HTTP status.
    status: int
    # In our words, with the upstream's status and its code when that is a known one: in
    # the client's error and on the decision row.
    says: str


QUOTED = MESSAGES[1]["content"]
UPSTREAM_ERRORS = {
    # The unknown `code` (the canary) is left out; the known `type` is repeated.
    "server-error-503": UpstreamError(
        {"kind": "serverError", "status": 503, "errorCode": ERROR_CANARY,
         "message": f"{ERROR_CANARY}: worker crashed on {QUOTED!r} (key {KEY_CANARY})"},
        stream=False, status=502, says="answered HTTP 503 (server_error)",
    ),
    "unauthorized-401-echoing-the-key": UpstreamError(
        {"kind": "serverError", "status": 401, "errorCode": "invalid_api_key",
         "message": f"Incorrect API key provided: {KEY_CANARY}. You can find your API key "
                    f"at {ERROR_CANARY}; request was {QUOTED!r}"},
        stream=True, status=502, says="answered HTTP 401 (invalid_api_key)",
    ),
    # The unknown `type` (the canary) is left out; the known `code` is repeated.
    "rate-limit-429": UpstreamError(
        {"kind": "rateLimit", "retryAfterSeconds": 1, "errorCode": "rate_limit_exceeded",
         "errorType": ERROR_CANARY,
         "message": f"{ERROR_CANARY}: rate limit for key {KEY_CANARY} on {PROMPT_CANARY}"},
        stream=False, status=429, says="answered HTTP 429 (rate_limit_exceeded)",
    ),
    # After the first token reached the client: it cannot move, the stream ends in an
    # error event of ours.
    "stream-error-mid-stream": UpstreamError(
        {"kind": "streamError", "afterTokens": 1, "errorCode": "server_error",
         "errorType": ERROR_CANARY,
         "message": f"{ERROR_CANARY}: provider died continuing {QUOTED!r} for {KEY_CANARY}"},
        stream=True, status=200, says="the upstream reported an error mid-stream (server_error)",
    ),
    # Before any content: the backup is tried, and fails the same way.
    "stream-error-before-content": UpstreamError(
        {"kind": "streamError", "afterTokens": 0, "errorCode": ERROR_CANARY,
         "message": f"{ERROR_CANARY}: refused {QUOTED!r} for {KEY_CANARY}"},
        stream=True, status=502, says="an error inside the answer before any content",
    ),
    # About the request: handed back to the client, never resent.
    "bad-request-400-quoting-the-prompt": UpstreamError(
        {"kind": "serverError", "status": 400,
         "message": f"Invalid 'messages[1].content': {QUOTED!r} ({ERROR_CANARY}, {KEY_CANARY})"},
        stream=False, status=400, says="HTTP 400 (invalid_request_error)",
    ),
}  # fmt: skip


async def _through_openai(proxy_url: str, stream: bool) -> str:
    """The error the real `openai` client raises (an error status, or an error event in the
    stream: 200), as its caller sees it: the status, the message and the body it parsed."""
    async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="x", max_retries=0) as ai:

        async def ask() -> None:
            if not stream:
                await ai.chat.completions.create(model="agent", messages=MESSAGES)
                return
            chunks = await ai.chat.completions.create(model="agent", messages=MESSAGES, stream=True)
            async for _ in chunks:
                pass

        with pytest.raises(openai.APIError) as caught:
            await ask()
    error = caught.value
    status = error.status_code if isinstance(error, openai.APIStatusError) else 200
    return f"{status} {error} {json.dumps(error.body, ensure_ascii=False)}"


async def _raw(proxy_url: str, stream: bool) -> str:
    """The proxy's answer as bytes on the wire: its status and whole body."""
    body = {"model": "agent", "messages": MESSAGES, "stream": stream}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(f"{proxy_url}/v1/chat/completions", json=body)
    return f"{answer.status_code} {answer.text}"


# Each request gets a proxy of its own: the first error trips a breaker (a 401 the whole
# provider, a 429 until its Retry-After), and a second request would not reach the upstream.
@pytest.mark.parametrize("via", ["openai", "raw"])
@pytest.mark.parametrize("case", UPSTREAM_ERRORS.values(), ids=UPSTREAM_ERRORS.keys())
async def test_no_upstream_error_text_leaks_into_any_surface(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    case: UpstreamError,
    via: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    fault = {**case.fault, "always": True}
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [
            {"name": "good", "faults": [fault]}, {"name": "backup", "faults": [fault]}]}]}
    )  # fmt: skip
    export = tmp_path / "outcomes.jsonl"
    spans = InMemorySpanExporter()
    proxy = await proxy_server(
        [_policy(sim.url), role_table(role("agent", [MODEL], patience=20))],
        secrets_dir=_secrets(tmp_path),
        outcome_export=str(export),
        admin_token=TOKEN,
        tracing=TraceSettings(spans, delay_seconds=0.01),
    )
    async with httpx.AsyncClient(timeout=10) as client:
        # The simulator does put the canaries in its error (asked directly, with no key).
        body = {"model": MODEL, "messages": MESSAGES, "stream": case.stream}
        direct = await client.post(f"{sim.url}/v1/chat/completions", json=body)
        for canary in ERROR_TEXT_CANARIES:
            assert canary in direct.text, f"the simulator's error does not carry {canary}"
        told = await (_through_openai if via == "openai" else _raw)(proxy.url, case.stream)
        await outcomes(proxy, 1)
        surfaces = await _read_surfaces(client, proxy.url)
        records = (await client.get(f"{sim.url}/_sim/requests")).json()
    # The request reached the simulator with the key, and met the fault there.
    fingerprint = hashlib.sha256(KEY_CANARY.encode()).hexdigest()[:12]
    proxied = [record for record in records if record["bearer_sha256"] == fingerprint]
    assert proxied
    assert len(proxied) == len(records) - 1  # the other one is the direct request
    assert {record["fault"] for record in proxied} == {fault["kind"]}
    await proxy.stop()  # flushes the exporter
    await asyncio.sleep(0)
    surfaces["export"] = export.read_text(encoding="utf-8")
    assert surfaces["export"].count("\n") == 1
    surfaces["spans"] = _spans(spans, 1)
    surfaces["logs"] = _logs(caplog)
    _assert_no_canary({f"client error ({via})": told, **surfaces})
    # The client is told what happened, in our words, with the upstream's status and known
    # code; the decision row says the same.
    assert told.startswith(f"{case.status} "), told
    assert case.says in told, told
    assert case.says in surfaces["decisions"]
