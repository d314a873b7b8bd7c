"""Test-facing control endpoints under `/_sim/`, plus `/healthz` and `/v1/models`.

Machines are addressed as `/_sim/machines/{model}/{machine}/faults`; the model segment may
contain `/` (`qwen/qwen3-coder`) because machine names cannot (the scenario forbids it), so
the route takes everything up to the last two segments as the model.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rolegate_sim.chat import SIM_STATE
from rolegate_sim.scenario import ScenarioError, dump_faults, parse_faults
from rolegate_sim.state import MachineState


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/_sim/requests", list_requests)
    app.router.add_post("/_sim/reset", reset)
    app.router.add_get("/_sim/machines", list_machines)
    faults_path = "/_sim/machines/{model:.+}/{machine}/faults"
    app.router.add_get(faults_path, get_faults)
    app.router.add_put(faults_path, put_faults)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(
        value, status=status, dumps=lambda v: json.dumps(v, ensure_ascii=False)
    )


def _problem(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "rolegate-sim"}
        for name in state.models
    ]
    return _json({"object": "list", "data": data})


async def list_requests(request: web.Request) -> web.Response:
    """All records in arrival order; `?since=N` returns only those with seq > N."""
    since_text = request.query.get("since", "0")
    try:
        since = int(since_text)
    except ValueError:
        return _problem(400, f"`since` must be an integer sequence number, got {since_text!r}")
    return _json(request.app[SIM_STATE].records_since(since))


async def list_machines(request: web.Request) -> web.Response:
    """Every machine's request counter and queue: answers in progress, requests waiting."""
    state = request.app[SIM_STATE]
    return _json(
        [
            machine.to_json()
            for model in state.models.values()
            for machine in model.machines.values()
        ]
    )


async def reset(request: web.Request) -> web.Response:
    """Forget records and zero the per-machine counters (the RNGs are keyed on them, so
    this reseeds too). Faults set at runtime stay, unless `?faults=restore` asks for the
    scenario's own faults back: the state of a freshly started simulator."""
    faults = request.query.get("faults", "keep")
    if faults not in ("keep", "restore"):
        return _problem(400, f"`faults` must be `keep` or `restore`, got {faults!r}")
    request.app[SIM_STATE].reset(restore_faults=faults == "restore")
    return _json({"reset": True, "faults": faults})


def _machine(request: web.Request) -> MachineState | web.Response:
    state = request.app[SIM_STATE]
    model_name = request.match_info["model"]
    machine_name = request.match_info["machine"]
    model = state.models.get(model_name)
    if model is None:
        return _problem(404, f"unknown model {model_name!r}; known: {', '.join(state.models)}")
    machine = model.machines.get(machine_name)
    if machine is None:
        known = ", ".join(model.machine_names)
        return _problem(
            404, f"model {model_name!r} has no machine {machine_name!r}; known: {known}"
        )
    return machine


async def get_faults(request: web.Request) -> web.Response:
    machine = _machine(request)
    if isinstance(machine, web.Response):
        return machine
    return _json(dump_faults(machine.faults))


async def put_faults(request: web.Request) -> web.Response:
    """Replace a machine's faults. Its request counter keeps counting, so `schedule`
    numbers refer to the machine's whole life unless `/_sim/reset` is called first."""
    machine = _machine(request)
    if isinstance(machine, web.Response):
        return machine
    try:
        data = json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _problem(400, f"body must be a JSON list of faults: {exc}")
    if not isinstance(data, list):
        return _problem(400, "body must be a JSON list of faults (use [] to clear them)")
    try:
        faults = parse_faults(data, source=f"PUT {request.path}")
    except ScenarioError as exc:
        return _problem(400, str(exc))
    machine.set_faults(faults)
    return _json(dump_faults(faults))
