from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from rolegate_sim.scenario import FAULT_KINDS

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table, sim_records

MODEL = "vendor/model-a"
SPARE = "vendor/model-b"
REPLY = "one two three four five six seven café eight nine — ten eleven twelve"
PROMPT: Any = [{"role": "user", "content": "say the numbers"}]

BACKED: dict[str, dict[str, Any]] = {
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
    "rateCollapse": {"afterTokens": 3, "tokensPerSecond": 40},
    "splitWrites": {},
    "down": {},
}
ALONE = {**BACKED, "stall": {"afterTokens": 3, "seconds": 30}, "cut": {"afterTokens": 3},
         "streamError": {"afterTokens": 3}}


async def _ask(url: str, role_name: str, stream: bool, request_id: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                  default_headers={"X-Request-Id": request_id}) as client:
        try:
            if not stream:
                c = await client.chat.completions.create(model=role_name, messages=PROMPT)
                return "ok" if c.choices[0].message.content == REPLY else f"wrong {c.choices[0].message.content!r}"
            chunks = await client.chat.completions.create(model=role_name, messages=PROMPT, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            return "ok" if text == REPLY else f"wrong {text!r}"
        except openai.APIStatusError as e:
            return f"status {e.status_code}"
        except openai.APIError as e:
            return f"error {e.message[:60]}"


@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_explore(sim_server: SimFactory, proxy_server: ProxyFactory, kind: str, tmp_path: Path) -> None:
    sim = await sim_server({"seed": 3, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [
            {"name": "bad", "faults": [{"kind": kind, "always": True, **BACKED[kind]}]}]},
        {"name": "vendor/model-solo", "reply": REPLY, "machines": [
            {"name": "bad", "faults": [{"kind": kind, "always": True, **ALONE[kind]}]}]},
        {"name": SPARE, "reply": REPLY, "machines": [{"name": "good"}]},
    ]})
    export = tmp_path / "o.jsonl"
    proxy = await proxy_server([
        provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"]}),
        provider_policy("solo", f"{sim.url}/v1", {"vendor/model-solo": ["bad"]}),
        provider_policy("spare", f"{sim.url}/v1", {SPARE: ["good"]}),
        role_table(role("backed", [MODEL, SPARE], patience=2), role("alone", ["vendor/model-solo"], patience=2)),
    ], outcome_export=str(export))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    plan = [(r, s, i) for r in ("backed", "alone") for s in (True, False) for i in range(2)]
    results = await asyncio.gather(*[_ask(proxy.url, r, s, f"{r}-{'s' if s else 'c'}-{i}") for r, s, i in plan])
    took = loop.time() - t0
    st = proxy.state
    pre = (st.outcomes.emitted, st.outcomes.dropped, len(st.outcomes), sorted(o.request_id for o in st.decisions.recent()))
    await proxy.stop()
    print("\nPRE-STOP emitted/dropped/buffered/decisions", pre)
    print("POST emitted", st.outcomes.emitted, "written", st.exporter.written, "xdropped", st.exporter.dropped, "decisions", sorted(o.request_id for o in st.decisions.recent()))
    lines = [json.loads(l) for l in export.read_bytes().splitlines()]
    by = {l["request_id"]: l for l in lines}
    print(f"\n=== {kind} took {took:.2f} lines={len(lines)}")
    for (r, s, i), res in zip(plan, results):
        o = by.get(f"{r}-{'s' if s else 'c'}-{i}")
        print(f"  {r:6} {'s' if s else 'c'} {i} client={res:30} ", o and (o["outcome"], o["status"], o["provider"], o["machine"], o["verdict"], [(a['machine'], a['result']) for a in o['arms']], [s['reason'][:40] for s in o['skipped']]))
