"""SPEC C7 and the issue's acceptance, through the real proxy and simulator: exactly one
outcome per client request, counted under every fault mode of the simulated provider, with
client disconnects and bad input included, and with the channel deliberately overloaded
(drops counted, requests unaffected).

Records are read where an operator would read them: the JSON-lines export
(`outcome_export`), `/metrics` and `GET /v1/rolegate/state`."""

from __future__ import annotations

import asyncio
import json
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolegate_proxy.edge.server import RunningProxy
from rolegate_sim import scenario
from rolegate_sim.scenario import FAULT_KINDS
from rolegate_sim.server import RunningSim

from ..support import (
    ProxyFactory,
    SimFactory,
    provider_policy,
    role,
    role_table,
    sim_records,
    wait_for_sim_record,
)
from ..waiting import eventually

MODEL = "vendor/model-a"  # the faulty machine's model, first in the role with a fallback
SOLO = "vendor/model-solo"  # the faulty machine's model in the role without one
SPARE = "vendor/model-b"  # the healthy fallback, on a provider of its own
# Non-ASCII, so that mojibake and replacement characters actually change the text.
REPLY = "one two three four five six seven café eight nine — ten eleven twelve"
PROMPT: Any = [{"role": "user", "content": "say the numbers"}]
PATIENCE = 2.0  # half of it bounds a silent upstream: stalls cost about a second
# The roles expect answers the size of REPLY, not the default 512 tokens: the patience test
# must refuse a machine for a fault, never for the speed a loaded test machine measured
# (512 tokens at the 80-150 tok/s that splitWrites' pauses measure under load is longer than
# the patience, and the second wave would skip the machine).
ANSWER_SIZE = {"expectedOutputTokens": 32}

# Breakers that never trip within a test: every request meets the fault itself (hard
# exclusions, a 429's, still apply), so each request's path, and its outcome, is fixed.
STEADY_BREAKER = {"novelSignatureCount": 10_000, "familiarSignatureCount": 10_000}

# The fault parameters per kind (short timings). For the role with a fallback, faults that
# take an `afterTokens` strike before any content, so the fallback can serve; for the role
# without one, after three tokens, so a streamed answer breaks after content reached the
# client. A kind missing here is run with no parameters (see EXPECTED).
WITH_FALLBACK: dict[str, dict[str, Any]] = {
    "rateLimit": {"retryAfterSeconds": 30},
    "serverError": {"status": 503},
    "reset": {},
    "noResponse": {"seconds": 30},
    "lateFirstToken": {"seconds": 0.3},
    "stall": {"afterTokens": 0, "seconds": 30},
    "cut": {"afterTokens": 0},
    "noDone": {},
    "streamError": {"afterTokens": 0},
    "empty": {},
    "mojibake": {},
    "replacementChar": {},
    # Slow enough to be a collapse, fast enough that the rate it teaches (ANSWER_SIZE
    # tokens expected) stays within the patience: the machine is not refused on the second
    # wave.
    "rateCollapse": {"afterTokens": 3, "tokensPerSecond": 400},
    "splitWrites": {},
    "down": {},
    "lingerAfterDone": {"seconds": 30},
    "multiLineEvents": {},
    "keepAliveComments": {"seconds": 0.3, "everySeconds": 0.1},
}
WITHOUT_FALLBACK: dict[str, dict[str, Any]] = {
    **WITH_FALLBACK,
    "stall": {"afterTokens": 3, "seconds": 30},
    "cut": {"afterTokens": 3},
    "streamError": {"afterTokens": 3},
}


@dataclass(frozen=True)
class Expect:
    outcome: str
    # Which machine's answer reached the client: the faulty one, the fallback, or none.
    served: str | None


BAD = Expect("answered", "bad")  # the fault left the answer usable
SPARED = Expect("answered", "good")  # the fallback served
BROKE = Expect("incomplete", "bad")  # content reached the client, then the stream broke
FAILED = Expect("failed", None)
REJECTED = Expect("rejected", None)

# (role, streamed) -> what each request comes to, per fault kind.
Plan = dict[tuple[str, bool], Expect]


def _plan(
    backed_stream: Expect, backed_complete: Expect, alone_stream: Expect, alone_complete: Expect
) -> Plan:
    return {
        ("backed", True): backed_stream,
        ("backed", False): backed_complete,
        ("alone", True): alone_stream,
        ("alone", False): alone_complete,
    }


BEFORE_CONTENT = _plan(SPARED, SPARED, FAILED, FAILED)
AFTER_CONTENT = _plan(SPARED, SPARED, BROKE, FAILED)
HARMLESS = _plan(BAD, BAD, BAD, BAD)
# A mangled answer is caught before it reaches the client only when it is not streamed;
# streamed, it is answered (with the verdict on the record) like any delivered stream.
MANGLED = _plan(BAD, SPARED, BAD, FAILED)
EXPECTED: dict[str, Plan] = {
    "rateLimit": BEFORE_CONTENT,
    "serverError": BEFORE_CONTENT,
    "reset": BEFORE_CONTENT,
    "noResponse": BEFORE_CONTENT,
    "lateFirstToken": HARMLESS,
    "stall": AFTER_CONTENT,
    "cut": AFTER_CONTENT,
    # The final chunk, then a clean end: a complete answer ([DONE] supplied; SPEC E4).
    "noDone": HARMLESS,
    "streamError": AFTER_CONTENT,
    "empty": BEFORE_CONTENT,
    "mojibake": MANGLED,
    "replacementChar": MANGLED,
    "rateCollapse": HARMLESS,
    "splitWrites": HARMLESS,
    # The aggregator answers 404 "No endpoints found" when a model's only machine is down:
    # about the candidate, not the request, so the role's next model answers.
    "down": BEFORE_CONTENT,
    # The complete answer is the end of the request, whatever the upstream does after it.
    "lingerAfterDone": HARMLESS,
    "multiLineEvents": HARMLESS,
    # One event that is not JSON is skipped and counted, never fatal (SPEC E4).
    "malformedEvent": HARMLESS,
    "keepAliveComments": HARMLESS,
    # Only a prefilled request is refused (none is here): rescues meet it (test_rescue.py).
    "refusePrefill": HARMLESS,
    # No usage chunk: the client asked for none here; when it does, rolegate counts.
    "noUsage": HARMLESS,
    # Only an answer with tool calls is broken, and these requests declare no tools.
    "malformedToolCall": HARMLESS,
}
MANGLING = {"mojibake", "replacementChar"}


# --- helpers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """What the client saw: a complete answer (its text), an HTTP error, or a broken stream."""

    text: str | None = None
    status: int | None = None
    broken: bool = False


async def _ask(url: str, role_name: str, stream: bool, request_id: str) -> Seen:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        headers = {"X-Request-Id": request_id}
        try:
            if not stream:
                completion = await client.chat.completions.create(
                    model=role_name, messages=PROMPT, extra_headers=headers
                )
                return Seen(text=completion.choices[0].message.content or "")
            chunks = await client.chat.completions.create(
                model=role_name, messages=PROMPT, stream=True, extra_headers=headers
            )
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            return Seen(text=text)
        except openai.APIStatusError as error:
            return Seen(status=error.status_code)
        except openai.APIError:
            return Seen(broken=True)  # an error event after content: the stream broke


async def _export_lines(path: Path, count: int) -> list[dict[str, Any]]:
    """The export file's records once it holds `count` of them."""

    async def enough() -> list[dict[str, Any]] | None:
        lines = _read_export(path)
        return lines if len(lines) >= count else None

    return await eventually(enough, what=f"{count} exported outcomes")


def _read_export(path: Path) -> list[dict[str, Any]]:
    """The export's complete records: the exporter writes from a worker thread, so a reader
    can catch its last line half written (no newline yet), which is not a record yet."""
    if not path.exists():
        return []
    complete, _, _partial = path.read_bytes().rpartition(b"\n")
    return [json.loads(line) for line in complete.splitlines()]


async def _exactly_once(
    proxy: RunningProxy, export: Path, request_ids: list[str]
) -> dict[str, dict[str, Any]]:
    """Every request id in the export exactly once and nothing else, then and after the
    proxy has stopped (which flushes the exporter): the records by request id."""
    assert len(set(request_ids)) == len(request_ids)
    await _export_lines(export, len(request_ids))
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{proxy.url}/v1/rolegate/state")).json()
    assert state["outcomes"]["emitted"] == len(request_ids)
    assert state["outcomes"]["dropped"] == 0
    await proxy.stop()
    lines = _read_export(export)
    ids = [line["request_id"] for line in lines]
    assert sorted(ids) == sorted(request_ids), "every request exactly once, nothing else"
    assert proxy.state.exporter is not None
    assert (proxy.state.exporter.written, proxy.state.exporter.dropped) == (len(ids), 0)
    return {line["request_id"]: line for line in lines}


def _fault_fired(records: list[dict[str, Any]], kind: str) -> bool:
    if kind == "down":
        return any("bad" in record["skipped_down"] for record in records)
    if kind == "splitWrites":
        return any(record["split_writes"] for record in records)
    if kind in ("refusePrefill", "malformedToolCall"):
        # They fire on prefilled requests, and answers with tool calls, only; these
        # reached the machine all the same.
        return any(record["machine"] == "bad" for record in records)
    return any(record["fault"] == kind for record in records)


def _scenario(kind: str) -> dict[str, Any]:
    def bad(params: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"name": "bad", "faults": [{"kind": kind, "always": True, **params.get(kind, {})}]}

    return {
        "seed": 11,
        "models": [
            {"name": MODEL, "reply": REPLY, "machines": [bad(WITH_FALLBACK)]},
            {"name": SOLO, "reply": REPLY, "machines": [bad(WITHOUT_FALLBACK)]},
            {"name": SPARE, "reply": REPLY, "machines": [{"name": "good"}]},
        ],
    }


# --- a. every fault kind of the simulator -------------------------------------------------------


def test_the_simulator_lists_every_fault_kind_it_accepts() -> None:
    """The parametrisation below follows FAULT_KINDS: it must be the whole list."""
    union = typing.get_args(typing.get_args(scenario.Fault)[0])
    parsed = {typing.get_args(cls.model_fields["kind"].annotation)[0] for cls in union}
    assert set(FAULT_KINDS) == parsed
    assert len(FAULT_KINDS) == len(parsed)


@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_every_request_has_exactly_one_outcome_under_each_fault(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path, kind: str
) -> None:
    sim = await sim_server(_scenario(kind))
    export = tmp_path / "outcomes.jsonl"
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"]}, breaker=STEADY_BREAKER),
            provider_policy("solo", f"{sim.url}/v1", {SOLO: ["bad"]}, breaker=STEADY_BREAKER),
            provider_policy("spare", f"{sim.url}/v1", {SPARE: ["good"]}),
            role_table(
                {**role("backed", [MODEL, SPARE], patience=PATIENCE), **ANSWER_SIZE},
                {**role("alone", [SOLO], patience=PATIENCE), **ANSWER_SIZE},
            ),
        ],
        outcome_export=str(export),
    )
    asks = [(r, s) for r in ("backed", "alone") for s in (True, False)]
    seen: dict[str, tuple[str, bool, Seen]] = {}
    # Two waves of concurrent requests: the second meets whatever the first left behind
    # (a rate limit's exclusion: refused without an attempt).
    for wave in (1, 2):
        ids = [f"{kind}-{r}-{'stream' if s else 'complete'}-{wave}" for r, s in asks]
        answers = await asyncio.gather(
            *[_ask(proxy.url, r, s, i) for (r, s), i in zip(asks, ids, strict=True)]
        )
        seen |= {i: (r, s, a) for (r, s), i, a in zip(asks, ids, answers, strict=True)}
    records = await _exactly_once(proxy, export, list(seen))
    assert _fault_fired(await sim_records(sim.url), kind), f"the {kind} fault never fired"

    wrong: list[str] = []
    for request_id, (role_name, stream, client) in seen.items():
        record = records[request_id]
        assert (record["role"], record["stream"]) == (role_name, stream)
        # The record says what the client saw.
        if client.text is not None:
            assert (record["outcome"], record["status"]) == ("answered", 200), request_id
            assert record["finish_reason"] == "stop"
            assert record["ttft_seconds"] is not None
            mangled = kind in MANGLING and record["machine"] == "bad"
            # A delivered mangled answer is served, but never scored: its arm is degraded.
            assert record["arms"][-1]["result"] == ("degraded" if mangled else "ok")
            assert (client.text != REPLY) == mangled, (request_id, client.text)
        elif client.broken:
            assert stream
            assert (record["outcome"], record["status"]) == ("incomplete", 200), request_id
            assert record["ttft_seconds"] is not None  # content had reached the client
        else:
            assert client.status == record["status"], request_id
            assert record["outcome"] in ("failed", "rejected")
            assert record["provider"] is None
            if record["outcome"] == "failed":
                assert record["status"] in (429, 502, 503, 504)
        if record["machine"] == "good":
            # The fallback was needed: the faulty machine failed or was refused first.
            assert any(a["provider"] == "agg" and a["result"] != "ok" for a in record["arms"]) or (
                any(s["provider"] == "agg" for s in record["skipped"])
            ), record
        expected = EXPECTED.get(kind, {}).get((role_name, stream))
        if expected is not None and (record["outcome"], record["machine"]) != (
            expected.outcome,
            expected.served,
        ):
            wrong.append(f"{request_id}: {record['outcome']} by {record['machine']}, {expected}")
    assert not wrong, wrong
    if kind == "rateLimit":
        # The second wave met the 429's exclusion: refused at once, with no attempt at all,
        # and counted all the same.
        fast = [records[f"rateLimit-alone-{mode}-2"] for mode in ("stream", "complete")]
        assert [(r["outcome"], r["arms"]) for r in fast] == [("failed", [])] * 2
        assert all(r["skipped"] for r in fast)
    if kind not in EXPECTED:
        pytest.fail(f"new fault kind {kind!r}: counted exactly once; now add it to EXPECTED")


# --- b. clients that go away --------------------------------------------------------------------


async def _one_machine_proxy(
    sim_server: SimFactory, proxy_server: ProxyFactory, export: Path, **machine: Any
) -> tuple[RunningSim, RunningProxy]:
    long_reply = " ".join(f"word{i}" for i in range(200))
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": long_reply,
                                "machines": [{"name": "m1", **machine}]}]}
    )  # fmt: skip
    return sim, await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL], patience=30)),
        ],
        outcome_export=str(export),
    )


def _body(stream: bool) -> dict[str, Any]:
    return {"model": "agent", "messages": PROMPT, "stream": stream}


def _assert_cancelled(record: dict[str, Any], detail: str) -> None:
    assert (record["outcome"], record["status"], record["role"]) == ("cancelled", 499, "agent")
    assert record["arms"], "the attempt the client walked away from is on the record"
    assert [a["result"] for a in record["arms"]] == ["cancelled"] * len(record["arms"])
    assert record["arms"][-1]["machine"] == "m1"
    assert detail in record["arms"][-1]["detail"]


async def test_a_client_that_leaves_mid_stream_has_one_cancelled_outcome(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    export = tmp_path / "outcomes.jsonl"
    _, proxy = await _one_machine_proxy(
        sim_server, proxy_server, export, ttftSeconds=0, tokensPerSecond=20
    )
    contents = 0
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=_body(True),
            headers={"X-Request-Id": "leaves-mid-stream"},
        ) as response,
    ):  # fmt: skip
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"word' in line.replace(" ", ""):
                contents += 1
                if contents == 2:
                    break  # two tokens read, then the client closes the connection
    assert contents == 2
    records = await _exactly_once(proxy, export, ["leaves-mid-stream"])
    record = records["leaves-mid-stream"]
    _assert_cancelled(record, "mid-stream")
    assert record["stream"] is True
    assert record["ttft_seconds"] is not None  # content had reached the client
    assert record["latency_seconds"] < 5  # when the client left, not the stream's 10 s end


async def _leave_before_the_first_token(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path, *, stream: bool
) -> dict[str, Any]:
    """A client that gives up on a machine whose first token is 20 s away: its record."""
    export = tmp_path / "outcomes.jsonl"
    late = [{"kind": "lateFirstToken", "always": True, "seconds": 20}]
    sim, proxy = await _one_machine_proxy(sim_server, proxy_server, export, faults=late)
    async with httpx.AsyncClient() as client:
        request = asyncio.create_task(
            client.post(
                f"{proxy.url}/v1/chat/completions",
                json=_body(stream),
                headers={"X-Request-Id": "leaves-early"},
            )
        )
        # The proxy's attempt has reached the machine, which holds its first token back.
        await wait_for_sim_record(sim.url, lambda record: record["outcome"] == "in_progress")
        assert not request.done()
        request.cancel()  # the client gives up: its connection is closed
        with pytest.raises(asyncio.CancelledError):
            await request
    started = time.monotonic()
    record = (await _exactly_once(proxy, export, ["leaves-early"]))["leaves-early"]
    assert time.monotonic() - started < 5  # noticed at once, not after the 20 s token
    assert (record["outcome"], record["status"], record["role"]) == ("cancelled", 499, "agent")
    assert record["stream"] is stream
    assert record["ttft_seconds"] is None
    assert record["latency_seconds"] < 5
    return record


async def test_a_client_that_leaves_before_the_first_token_has_one_cancelled_outcome(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    record = await _leave_before_the_first_token(sim_server, proxy_server, tmp_path, stream=True)
    _assert_cancelled(record, "before the first token")


async def test_a_client_that_leaves_a_non_streamed_request_has_one_cancelled_outcome(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    await _leave_before_the_first_token(sim_server, proxy_server, tmp_path, stream=False)


async def test_a_non_streamed_attempt_the_client_left_is_a_cancelled_arm(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    record = await _leave_before_the_first_token(sim_server, proxy_server, tmp_path, stream=False)
    _assert_cancelled(record, "client")


# --- c. bad input -------------------------------------------------------------------------------


async def _one_machine(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path, **settings: Any
) -> tuple[RunningSim, RunningProxy, Path]:
    """A healthy one-machine simulator, a proxy for role `agent` exporting its outcomes."""
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m1"}]}]})
    export = tmp_path / "outcomes.jsonl"
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        outcome_export=str(export),
        **settings,
    )
    return sim, proxy, export


async def test_bad_input_has_exactly_one_rejected_outcome_each(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    sim, proxy, export = await _one_machine(sim_server, proxy_server, tmp_path, max_body_bytes=2048)
    url = f"{proxy.url}/v1/chat/completions"
    big = json.dumps({"model": "agent", "messages": [{"role": "user", "content": "x" * 4096}]})

    async def chunked() -> Any:  # no Content-Length: the limit is met while reading
        for start in range(0, len(big), 512):
            yield big[start : start + 512].encode()

    json_type = {"Content-Type": "application/json"}
    cases: dict[str, tuple[int, str, dict[str, Any]]] = {
        "bad-json": (400, "invalid_json", {"content": b'{"model": "agent", "messages": [}'}),
        "not-utf8": (400, "invalid_encoding", {"content": b'{"model": "\xff"}'}),
        "not-an-object": (400, "invalid_body", {"content": b"[1, 2]"}),
        "no-model": (400, "missing_model", {"json": {"messages": PROMPT}}),
        "unknown-role": (404, "unknown_role", {"json": {"model": "nobody", "messages": PROMPT}}),
        "unknown-role-header": (
            404,
            "unknown_role",
            {"json": _body(False), "headers": {"X-Rolegate-Role": "nobody"}},
        ),
        "too-large": (413, "body_too_large", {"content": big.encode()}),
        "too-large-chunked": (413, "body_too_large", {"content": chunked()}),
    }
    async with httpx.AsyncClient() as client:
        for request_id, (status, _code, send) in cases.items():
            headers = {**json_type, **send.pop("headers", {}), "X-Request-Id": request_id}
            response = await client.post(url, headers=headers, **send)
            assert response.status_code == status, (request_id, response.text)
            assert response.headers["X-Request-Id"] == request_id
    records = await _exactly_once(proxy, export, list(cases))
    for request_id, (status, code, _send) in cases.items():
        record = records[request_id]
        assert (record["outcome"], record["status"], record["error_code"]) == (
            "rejected",
            status,
            code,
        ), request_id
        assert record["role"] is None, request_id  # refused before a role was chosen
        assert (record["arms"], record["provider"], record["machine"]) == ([], None, None)
    assert await sim_records(sim.url) == []  # nothing bad reached the upstream


async def test_a_request_refused_after_its_role_was_chosen_keeps_the_role(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    _, proxy, export = await _one_machine(sim_server, proxy_server, tmp_path)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "agent", "messages": [], "stream": True},
            headers={"X-Request-Id": "no-messages"},
        )
    assert response.status_code == 400
    assert response.headers["X-Rolegate-Role"] == "agent"  # the role was chosen
    record = (await _exactly_once(proxy, export, ["no-messages"]))["no-messages"]
    assert (record["outcome"], record["error_code"]) == ("rejected", "invalid_messages")
    assert record["role"] == "agent"


# --- d. an overloaded channel -------------------------------------------------------------------


def _counter(metrics_text: str, name: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not on /metrics")


async def test_an_overloaded_channel_drops_and_counts_and_requests_are_unaffected(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": REPLY, "machines": [{"name": "m1"}]}]}
    )
    export = tmp_path / "outcomes.jsonl"
    # Room for four records, and a drainer that lets a batch gather for 30 s: nothing is
    # consumed during the test, so 46 of the 50 records must be evicted.
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        outcome_buffer=4,
        outcome_batch_seconds=30,
        outcome_export=str(export),
    )
    ids = [f"burst-{i}" for i in range(50)]
    answers = await asyncio.gather(
        *[_ask(proxy.url, "agent", n % 2 == 0, request_id) for n, request_id in enumerate(ids)]
    )
    assert answers == [Seen(text=REPLY)] * 50  # every request complete, none slowed or lost
    assert len(await sim_records(sim.url)) == 50

    async with httpx.AsyncClient() as client:
        metrics_text = (await client.get(f"{proxy.url}/metrics")).text
        state = (await client.get(f"{proxy.url}/v1/rolegate/state")).json()
        decisions = (await client.get(f"{proxy.url}/v1/rolegate/decisions")).json()
    assert _counter(metrics_text, "rolegate_outcomes_emitted_total") == 50
    assert _counter(metrics_text, "rolegate_outcomes_dropped_total") == 46
    assert _counter(metrics_text, "rolegate_outcome_export_dropped_total") == 0
    assert state["outcomes"] == {"emitted": 50, "dropped": 46, "buffered": 4, "capacity": 4}
    assert decisions["decisions"] == []  # no consumer has had a batch yet
    assert not export.exists() or export.read_bytes() == b""

    # Stopping does not wait out the 30 s batch: the four survivors reach the consumers.
    started = time.monotonic()
    await proxy.stop()
    assert time.monotonic() - started < 5
    assert proxy.state.outcomes.wake is None  # the drain's cleanup ran to its end
    leftover = [t for t in asyncio.all_tasks() if t.get_name().startswith("rolegate-")]
    assert leftover == []
    survivors = [line["request_id"] for line in _read_export(export)]
    assert len(survivors) == len(set(survivors)) == 4
    assert set(survivors) <= set(ids)
    assert [o.request_id for o in proxy.state.decisions.recent()] == survivors
    assert (proxy.state.outcomes.emitted, proxy.state.outcomes.dropped) == (50, 46)
