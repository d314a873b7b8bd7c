"""How often the mid-stream rate test moves a healthy stream (SPEC B5): the false-act rate.

The simulated provider serves three healthy machines whose real speed matches what their
ProviderPolicy publishes, with realistic jitter (±25 % per token); the proxy relays
1,000 streamed requests (the official `openai` client, 16 at a time), and the acts the
rate test decided are read from the proxy's `/metrics`. Every act here is a false one.

Run: `.venv/bin/python bench/false_acts.py [--streams 1000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolegate_policy.compile import compile_manifests
from rolegate_policy.manifests import manifest_from_object
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import start as start_sim

MODEL = "bench/model"
MACHINES = {"m90": 90.0, "m105": 105.0, "m120": 120.0}


async def main(streams: int, tokens: int) -> int:
    reply = " ".join(f"w{i}" for i in range(tokens))
    sim = await start_sim(
        parse_scenario(
            {
                "seed": 11,
                "models": [
                    {
                        "name": MODEL,
                        "reply": reply,
                        "machines": [
                            {"name": n, "ttftSeconds": 0.05, "tokensPerSecond": r, "jitter": 0.25,
                             "continuesPartialMessage": True}
                            for n, r in MACHINES.items()
                        ],
                    }
                ],
            }
        )
    )  # fmt: skip
    objects = [
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "ProviderPolicy",
            "metadata": {"name": "sim"},
            "spec": {
                "endpoint": f"{sim.url}/v1",
                "dialect": "Aggregator",
                "models": [
                    {"name": MODEL, "machines": [
                        {"name": n, "ttftSeconds": 0.05, "tokensPerSecond": r,
                         "continuesPartialMessage": True}
                        for n, r in MACHINES.items()]}
                ],
            },
        },
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "RoleTable",
            "metadata": {"name": "bench"},
            "spec": {"roles": [{"name": "agent", "models": [MODEL], "patienceSeconds": 60,
                                "visibility": "Watched", "expectedOutputTokens": tokens}]},
        },
        {   # the benchmark's client calls without a credential: an explicit open grant
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "AccessGrant",
            "metadata": {"name": "bench"},
            "spec": {"subjects": [{"anonymous": True}], "roles": ["agent"]},
        },
    ]  # fmt: skip
    config = compile_manifests(
        [manifest_from_object(o, f"bench#{i}") for i, o in enumerate(objects)]
    ).config
    proxy = await start_proxy(ProxySettings(port=0, metrics_on_api_port=True), config)
    started = time.monotonic()
    try:
        gate = asyncio.Semaphore(16)
        async with openai.AsyncOpenAI(
            base_url=f"{proxy.url}/v1", api_key="x", max_retries=0
        ) as client:

            async def one() -> bool:
                async with gate:
                    stream = await client.chat.completions.create(
                        model="agent", messages=[{"role": "user", "content": "go"}], stream=True
                    )
                    text = "".join(
                        [c.choices[0].delta.content or "" async for c in stream if c.choices]
                    )
                    return text == reply

            complete = sum(await asyncio.gather(*(one() for _ in range(streams))))
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{proxy.url}/metrics")).text
    finally:
        await proxy.stop()
        await sim.stop()
    acts = sum(float(v) for v in re.findall(r"^rolegate_acts_total\{[^}]*\} (\S+)$", metrics, re.M))
    took = time.monotonic() - started
    rates = ", ".join(f"{r:g}" for r in MACHINES.values())
    print(f"streams: {streams} ({tokens} tokens each, machines at {rates} tok/s, jitter ±25%)")
    print(f"complete answers: {complete}/{streams}")
    print(f"acts (all false): {acts:.0f} -> false-act rate {acts / streams:.2%} (goal < 1%)")
    print(f"wall time: {took:.1f} s")
    return 0 if complete == streams else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.streams, args.tokens)))
