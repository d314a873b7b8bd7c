"""What a caller can learn by asking (issue 30, finding 7), through the real proxy: a role
it may not use is answered word for word as a role that does not exist, whoever asks and
however the role is named; the name asked for is never repeated, in an answer or a log
line; and a caller with an API key is never told the Secret that holds it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolegate_proxy.edge.server import RunningProxy

from ..support import (
    ProxyFactory,
    SimFactory,
    access_grant,
    one_machine_sim,
    outcomes,
    provider_policy,
    role,
    role_table,
)

MODEL = "vendor/model-a"
CHAT = "/v1/chat/completions"
PROMPT: Any = [{"role": "user", "content": "hi"}]
# Secret names a caller must never be told (the keys they hold are theirs to know).
CI_SECRET, OPS_SECRET = "zq7-ci-secret", "zq7-ops-secret"
KEY_NAME = "zq7-key"
CI_KEY, OPS_KEY = "sk-ci-5b1e", "sk-ops-77d0"
# A role name asked for that no RoleTable defines: planted, so an echo is found.
MISSING = "zq7marker-role"


@pytest.fixture
async def proxy(sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path) -> RunningProxy:
    """Roles agent, batch and reflex. The CI key may use batch; anyone (no credential, or an
    unknown one) reflex; the ops key administers and has no role."""
    sim = await one_machine_sim(sim_server, MODEL, reply="ok", tokens_per_second=500)
    secrets = tmp_path / "secrets"
    for secret, value in ((CI_SECRET, CI_KEY), (OPS_SECRET, OPS_KEY)):
        (secrets / secret).mkdir(parents=True)
        (secrets / secret / KEY_NAME).write_text(value)
    return await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(*(role(name, [MODEL]) for name in ("agent", "batch", "reflex"))),
            access_grant(
                "ci", [{"apiKeySecretRef": {"name": CI_SECRET, "key": KEY_NAME}}], ["batch"]
            ),
            access_grant("anyone", [{"anonymous": True}], ["reflex"]),
            access_grant(
                "ops", [{"apiKeySecretRef": {"name": OPS_SECRET, "key": KEY_NAME}}], [],
                admin=True,
            ),
        ],
        secrets_dir=secrets,
    )  # fmt: skip


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _ask(
    proxy: RunningProxy, key: str | None, name: str, *, by_header: bool
) -> httpx.Response:
    """A chat request naming role `name` in `model`, or in X-Rolegate-Role."""
    headers = _bearer(key)
    body: dict[str, Any] = {"model": name, "messages": PROMPT}
    if by_header:
        headers["X-Rolegate-Role"] = name
        body["model"] = "anything"
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(f"{proxy.url}{CHAT}", json=body, headers=headers)


@pytest.mark.parametrize("by_header", [False, True])
@pytest.mark.parametrize(
    ("key", "theirs", "lacked"),
    [
        (CI_KEY, "batch", "agent"),  # a known caller
        (None, "reflex", "batch"),  # no credential, let in by an anonymous grant
        ("sk-unknown", "reflex", "agent"),  # a key nobody issued: as anonymous
    ],
)
async def test_a_role_the_caller_lacks_is_answered_as_one_that_does_not_exist(
    proxy: RunningProxy,
    caplog: pytest.LogCaptureFixture,
    key: str | None,
    theirs: str,
    lacked: str,
    by_header: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    assert (await _ask(proxy, key, theirs, by_header=by_header)).status_code == 200
    exists = await _ask(proxy, key, lacked, by_header=by_header)
    missing = await _ask(proxy, key, MISSING, by_header=by_header)
    # The same status, the same body byte for byte, the same headers but the request id.
    assert exists.status_code == missing.status_code == 404, (exists.text, missing.text)
    assert exists.content == missing.content
    varying = {"date", "x-request-id"}
    assert {k: v for k, v in exists.headers.items() if k not in varying} == {
        k: v for k, v in missing.headers.items() if k not in varying
    }
    error = missing.json()["error"]
    assert error["code"] == "unknown_role"
    assert error["param"] == ("X-Rolegate-Role" if by_header else "model")
    assert error["message"].endswith(f"Your roles: {theirs}.")
    # Nothing of what was asked, nor of the roles it lacks, is said back, or logged.
    assert MISSING not in missing.text
    assert lacked not in missing.text
    server_side = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert not [r.getMessage() for r in server_side if MISSING in r.getMessage()]
    # Filed alike: refused, the role unnamed, the same code.
    *_, of_exists, of_missing = await outcomes(proxy, 3)
    for outcome in (of_exists, of_missing):
        assert (outcome.role, outcome.grant, outcome.status, outcome.error_code) == (
            None, None, 404, "unknown_role"
        )  # fmt: skip


async def test_a_long_role_name_is_not_repeated_in_any_part(proxy: RunningProxy) -> None:
    name = MISSING * 300  # 3,900 characters: within the parser's header limit
    for by_header in (False, True):
        answer = await _ask(proxy, CI_KEY, name, by_header=by_header)
        assert answer.status_code == 404
        assert "zq7marker" not in answer.text
        assert not any("zq7marker" in value for value in answer.headers.values())
        assert len(answer.content) < 400


async def test_a_caller_with_a_key_is_never_told_its_secret(proxy: RunningProxy) -> None:
    """The ops key has no role, the CI key no admin right: both are refused 403, each told
    what it lacks, neither told which Secret (or key of it) it is."""
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        refusals = [
            await client.post(CHAT, json={"model": "agent", "messages": PROMPT},
                              headers=_bearer(OPS_KEY)),
            await client.get("/v1/models", headers=_bearer(OPS_KEY)),
            await client.get("/v1/rolegate/state", headers=_bearer(CI_KEY)),
            await client.get("/v1/rolegate/decisions", headers=_bearer(CI_KEY)),
        ]  # fmt: skip
    for answer in refusals:
        assert answer.status_code == 403, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("This API key "), message
        for secret in (CI_SECRET, OPS_SECRET, KEY_NAME):
            assert secret not in json.dumps(answer.json()), message
