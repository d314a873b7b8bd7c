"""`--log-format json` on the real proxy: every log line is a JSON object, each request has
an access line naming its request id, role, provider, machine and outcome, and no line
carries a payload (SPEC C8, E1).

Canaries go into the prompt, the completion, the caller's bearer token, the provider's API
key, a caller's malformed X-Request-Id and the text of an upstream's errors; the real
`openai` client sends through the proxy to the simulator, with everything logged at DEBUG
through the JSON formatter the command installs.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rolegate_cli.logs import JsonFormatter

from ..support import ProxyFactory, SimFactory, outcomes, role, role_table

MODEL = "vendor/model-a"
PROMPT_CANARY = "canary-prompt-0a71"
COMPLETION_CANARY = "canary-completion-93c2"
CALLER_KEY_CANARY = "sk-canary-caller-5e8b"
PROVIDER_KEY_CANARY = "sk-canary-provider-d04f"
REQUEST_ID_CANARY = "canary-request-id-61aa"
ERROR_CANARY = "canary-upstream-error-2b9e"
CANARIES = (
    PROMPT_CANARY,
    COMPLETION_CANARY,
    CALLER_KEY_CANARY,
    PROVIDER_KEY_CANARY,
    REQUEST_ID_CANARY,
    ERROR_CANARY,
)
MESSAGES: Any = [{"role": "user", "content": f"Repeat {PROMPT_CANARY} please"}]
GIVEN_ID = "req-from-caller-1"
ACCESS_FIELDS = {
    "request_id", "role", "provider", "model", "machine", "outcome", "status", "stream",
    "attempts", "ttft_ms", "total_ms", "error_code", "config_hash",
}  # fmt: skip


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """Every record of the process at DEBUG, through the command's JSON formatter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield stream
    root.removeHandler(handler)
    root.setLevel(saved)


def _policy(url: str) -> dict[str, Any]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "agg", "namespace": "test"},
        "spec": {
            "endpoint": f"{url}/v1",
            "dialect": "Aggregator",
            "apiKeySecretRef": {"name": "agg-key", "key": "apiKey"},
            "models": [{"name": MODEL, "machines": [{"name": "good"}, {"name": "backup"}]}],
        },
    }


def _secrets(tmp_path: Path) -> Path:
    secrets = tmp_path / "secrets"
    (secrets / "agg-key").mkdir(parents=True)
    (secrets / "agg-key" / "apiKey").write_text(PROVIDER_KEY_CANARY + "\n")
    return secrets


# In this process but not the proxy: the upstream, and the test's own client (whose debug
# log shows the request it sends).
NOT_THE_PROXY = ("rolegate.sim", "openai", "httpx", "httpcore")


def _ours(text: str) -> list[dict[str, Any]]:
    """Each line as JSON (it must be), but those the proxy did not write."""
    assert text.endswith("\n")
    entries = [json.loads(line) for line in text.splitlines()]
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
    return [entry for entry in entries if not entry["logger"].startswith(NOT_THE_PROXY)]


async def test_json_lines_carry_each_requests_fields_and_no_payload(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path, json_log: io.StringIO
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": f"It is {COMPLETION_CANARY}.",
                                "machines": [{"name": "good"}, {"name": "backup"}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [_policy(sim.url), role_table(role("agent", [MODEL], patience=20))],
        secrets_dir=_secrets(tmp_path),
    )
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key=CALLER_KEY_CANARY, max_retries=0
    ) as ai:
        answer = await ai.chat.completions.create(
            model="agent", messages=MESSAGES, extra_headers={"X-Request-Id": GIVEN_ID}
        )
        assert COMPLETION_CANARY in (answer.choices[0].message.content or "")
        stream = await ai.chat.completions.create(
            model="agent",
            messages=MESSAGES,
            stream=True,
            # Not a sane token (spaces): replaced by a fresh id, never logged.
            extra_headers={"X-Request-Id": f"{REQUEST_ID_CANARY} with spaces"},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert COMPLETION_CANARY in text
        # Both machines refuse the key with an error whose text echoes it, quotes the
        # prompt and carries a canary of its own; the provider's breaker trips at once.
        fault = {"kind": "serverError", "always": True, "status": 401,
                 "errorCode": ERROR_CANARY,
                 "message": f"Incorrect API key {PROVIDER_KEY_CANARY} ({ERROR_CANARY}) "
                            f"for {PROMPT_CANARY}"}  # fmt: skip
        async with httpx.AsyncClient(timeout=10) as client:
            for machine in ("good", "backup"):
                put = await client.put(
                    f"{sim.url}/_sim/machines/{MODEL}/{machine}/faults", json=[fault]
                )
                assert put.status_code == 200
            direct = await client.post(
                f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
            )
            assert ERROR_CANARY in direct.text  # the upstream's error does carry it
        with pytest.raises(openai.APIStatusError) as failed:
            await ai.chat.completions.create(model="agent", messages=MESSAGES)
        assert failed.value.status_code == 502
        # Refused before any role: an unknown one.
        with pytest.raises(openai.NotFoundError):
            await ai.chat.completions.create(model=f"role-{PROMPT_CANARY}", messages=MESSAGES)
    await outcomes(proxy, 4)
    await proxy.stop()

    entries = _ours(json_log.getvalue())
    everything = "\n".join(json.dumps(entry, ensure_ascii=False) for entry in entries)
    for canary in CANARIES:
        assert canary not in everything, f"{canary} leaked into a log line"
    access = [entry for entry in entries if entry["logger"] == "rolegate.proxy.access"]
    assert [entry["outcome"] for entry in access] == ["answered", "answered", "failed", "rejected"]
    for entry in access:
        assert entry.keys() >= ACCESS_FIELDS, entry
        assert entry["level"] == "INFO"
        assert entry["message"].startswith(f"request id={entry['request_id']} ")
    plain, streamed, failure, refused = access
    assert plain["request_id"] == GIVEN_ID
    assert len(streamed["request_id"]) == 32  # a fresh one
    for served in (plain, streamed):
        assert served["role"] == "agent"
        assert served["provider"] == "agg"
        assert served["model"] == MODEL
        assert served["machine"] in {"good", "backup"}
        assert served["status"] == 200
        assert served["attempts"] == 1
        assert served["ttft_ms"] > 0
        assert served["total_ms"] >= served["ttft_ms"]
    assert streamed["stream"] is True
    assert failure["status"] == 502
    assert failure["attempts"] >= 1
    assert failure["role"] == "agent"
    assert failure["provider"] is None
    assert refused["status"] == 404
    assert refused["role"] is None
    assert refused["error_code"] == "unknown_role"
    # The breaker's warning about the refused key is a JSON line too.
    tripped = [entry for entry in entries if entry["message"].startswith("breaker tripped")]
    assert tripped, entries
    assert tripped[0]["level"] == "WARNING"
