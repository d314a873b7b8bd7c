"""The degraded-output signatures through the real proxy and simulator: each signature,
streamed and not, with its `spec.degradedOutput` toggle on and off (SPEC A2-A6).

One expectation per cell, written out here rather than read from the signature table the
code uses, so the table itself is under test: what the client gets, what the outcome
record says, and whether the breaker counted it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from rolegate_policy.signatures import RULES, Signature

from ..support import ProxyFactory, SimFactory, outcomes, provider_policy, role, role_table

MODEL = "vendor/model-a"
# Non-ASCII, so that mangling changes it; the prompt is ASCII, so it is the model's fault.
REPLY = "the caf\u00e9 opens at nine \u2014 bring the key"
PROMPT: Any = [{"role": "user", "content": "when does it open"}]


@dataclass(frozen=True)
class Cell:
    # The client got an answer (200) rather than rolegate's error.
    served: bool
    # The `verdict` on the outcome record (the served answer's, or the failed arm's kind).
    verdict: str
    # The breaker counted it: two in a row trip the key (a novel signature, n >= 2).
    trips: bool


CAUGHT = Cell(served=False, verdict="", trips=True)  # counted before any byte reached the client
EXPECTED: dict[tuple[str, bool, bool], Cell] = {
    # (fault, streamed, toggle on)
    ("empty", False, True): CAUGHT,
    ("empty", True, True): CAUGHT,
    ("empty", False, False): Cell(served=True, verdict="malformed", trips=False),
    ("empty", True, False): Cell(served=True, verdict="malformed", trips=False),
    ("mojibake", False, True): CAUGHT,
    # A stream cannot be judged before it reaches the client: served, counted all the same.
    ("mojibake", True, True): Cell(served=True, verdict="mangled", trips=True),
    ("mojibake", False, False): Cell(served=True, verdict="mangled", trips=False),
    ("mojibake", True, False): Cell(served=True, verdict="mangled", trips=False),
    ("replacementChar", False, True): CAUGHT,
    ("replacementChar", True, True): Cell(served=True, verdict="mangled", trips=True),
    ("replacementChar", False, False): Cell(served=True, verdict="mangled", trips=False),
    ("replacementChar", True, False): Cell(served=True, verdict="mangled", trips=False),
    # A broken tool call is held until judged, streamed or not: caught before any byte.
    ("brokenArguments", False, True): CAUGHT,
    ("brokenArguments", True, True): CAUGHT,
    ("brokenArguments", False, False): Cell(served=True, verdict="malformed", trips=False),
    ("brokenArguments", True, False): Cell(served=True, verdict="malformed", trips=False),
    ("undeclaredTool", False, True): CAUGHT,
    ("undeclaredTool", True, True): CAUGHT,
    ("undeclaredTool", False, False): Cell(served=True, verdict="malformed", trips=False),
    ("undeclaredTool", True, False): Cell(served=True, verdict="malformed", trips=False),
}
SIGNATURE_OF = {
    "empty": Signature.EMPTY_RESPONSE,
    "mojibake": Signature.DOUBLE_ENCODED_UTF8,
    "replacementChar": Signature.REPLACEMENT_CHARACTER,
    "brokenArguments": Signature.TOOL_ARGUMENTS_NOT_JSON,
    "undeclaredTool": Signature.UNDECLARED_TOOL,
}
# What a trip takes out, and why: an empty answer or a broken call is the model's,
# mangling the provider's.
TRIP_OF = {
    "empty": ("Model", "EmptyResponses"),
    "mojibake": ("Provider", "MangledOutput"),
    "replacementChar": ("Provider", "MangledOutput"),
    "brokenArguments": ("Model", "MalformedToolCalls"),
    "undeclaredTool": ("Model", "MalformedToolCalls"),
}
# The simulator's fault for each row, and the tool calls its answers make (declared by
# the requests that meet them): a call alone, so nothing of it reaches a client before
# it is judged.
SIM_FAULT = {
    "brokenArguments": {"kind": "malformedToolCall", "flaw": "arguments"},
    "undeclaredTool": {"kind": "malformedToolCall", "flaw": "name"},
}
TOOL_CALL = {"name": "open_hours", "arguments": '{"day": "monday"}'}
TOOLS: Any = [{"type": "function", "function": {"name": "open_hours", "parameters": {}}}]


def test_every_acting_signature_has_a_row_in_the_matrix() -> None:
    acting = {signature for signature, rule in RULES.items() if rule.acts}
    assert acting == set(SIGNATURE_OF.values())


async def _ask(url: str, stream: bool, **extra: Any) -> bool:
    """One request; whether the client got an answer (else rolegate's 502)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        try:
            if stream:
                chunks = await client.chat.completions.create(
                    model="agent", messages=PROMPT, stream=True, **extra
                )
                _ = [chunk async for chunk in chunks]
            else:
                await client.chat.completions.create(model="agent", messages=PROMPT, **extra)
        except openai.APIStatusError as error:
            return error.status_code != 502
    return True


async def _tripped(url: str) -> set[tuple[str, str | None]]:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{url}/v1/rolegate/state")).json()
    return {(b["scope"], b["reason"]) for b in state["breakers"] if b["state"] != "Closed"}


@pytest.mark.parametrize("toggle", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("fault", list(SIGNATURE_OF))
async def test_a_signature_does_what_its_row_says_streamed_or_not(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: str, stream: bool, toggle: bool
) -> None:
    calls = fault in SIM_FAULT
    sim = await sim_server(
        {"seed": 1, "models": [{
            "name": MODEL, "reply": "" if calls else REPLY,
            "toolCalls": [TOOL_CALL] if calls else [],
            "machines": [{"name": "m1", "faults": [
                {**SIM_FAULT.get(fault, {"kind": fault}), "always": True}]}],
        }]}
    )  # fmt: skip
    degraded = {
        "detectEmpty": toggle, "detectMangled": toggle, "detectMalformedToolCalls": toggle
    }  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy(
                "agg", f"{sim.url}/v1", {MODEL: ["m1"]}, degradedOutput=degraded,
                breaker={"cooldownSeconds": 60},
            ),
            role_table(role("agent", [MODEL])),
        ]
    )  # fmt: skip
    expected = EXPECTED[fault, stream, toggle]
    extra = {"tools": TOOLS} if calls else {}
    served = [await _ask(proxy.url, stream, **extra) for _ in range(2)]
    assert served == [expected.served] * 2

    records = await outcomes(proxy, 2)
    for record in records:
        if expected.served:
            assert (record.outcome.value, record.verdict) == ("answered", expected.verdict)
        else:
            assert record.outcome.value == "failed"
            assert record.arms[-1].result.value in (
                "empty_success", "degraded", "malformed_tool_call"
            )  # fmt: skip
    assert await _tripped(proxy.url) == ({TRIP_OF[fault]} if expected.trips else set())
