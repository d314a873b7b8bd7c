"""Who is calling, and what grants say they may do: pure parts and the edge's cache,
with a reviewer standing in for the API server (the real one: tests/k8s/test_token_review)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rolegate_policy.config import CompiledGrant, SecretRef
from rolegate_proxy.core.access import ANONYMOUS, UNKNOWN_KEY, Grants, Subject
from rolegate_proxy.edge.callers import ApiKeys, Authenticator, ReviewUnavailable
from rolegate_proxy.wire.errors import ProxyError

CI_KEY = SecretRef(name="ci", key="token")
AGENTS = CompiledGrant(name="team-a/agents", source="t", roles=("agent",), namespaces=("team-a",))
CI = CompiledGrant(name="ci/batch", source="t", roles=("batch",), api_keys=(CI_KEY,))
CODER = CompiledGrant(
    name="team-b/coder",
    source="t",
    roles=("agent", "reflex"),
    service_accounts=("team-b/coder",),
)
LOCAL = CompiledGrant(name="dev/local", source="t", roles=("*",), anonymous=True)
TOKEN = "header.payload.signature"


def test_a_namespace_grant_admits_its_accounts_to_its_roles_only() -> None:
    grants = Grants([AGENTS, CI, CODER])
    caller = Subject.service_account("team-a", "anyone")
    assert grants.admitting(caller, "agent") == (AGENTS,)
    assert grants.admitting(caller, "batch") == ()
    assert grants.admitting(Subject.service_account("team-c", "anyone"), "agent") == ()
    assert grants.admitting(Subject.service_account("team-b", "coder"), "reflex") == (CODER,)


def test_grants_asked_about_callers_in_turn_answer_each_its_own() -> None:
    grants = Grants([AGENTS, CI, CODER, LOCAL])
    coder = Subject.service_account("team-b", "coder")
    agent = Subject.service_account("team-a", "anyone")
    for _ in range(2):  # each question after another caller's, and after its own
        for caller, expected in ((coder, (CODER,)), (ANONYMOUS, (LOCAL,)), (agent, (AGENTS,))):
            assert grants.of(caller) == expected
            assert grants.of(caller) == expected
        # An equal subject that is another object: the same grants.
        assert grants.of(Subject.service_account("team-b", "coder")) == (CODER,)


def test_anonymous_callers_need_a_grant_that_says_so() -> None:
    assert Grants([AGENTS, CI]).admitting(ANONYMOUS, "agent") == ()
    assert Grants([LOCAL]).admitting(ANONYMOUS, "anything") == (LOCAL,)


def test_only_a_grant_with_admin_lets_its_subjects_administer() -> None:
    ops = CompiledGrant(name="ops/ops", source="t", roles=(), admin=True, namespaces=("ops",))
    grants = Grants([AGENTS, LOCAL, ops])
    assert grants.administers(Subject.service_account("ops", "oncall"))
    assert not grants.administers(Subject.service_account("team-a", "anyone"))
    assert not grants.administers(ANONYMOUS)


def test_an_api_key_matches_by_digest_and_nothing_else_does() -> None:
    keys = ApiKeys({CI_KEY: "sk-ci-secret", SecretRef(name="gone", key="k"): None})
    assert keys.match("sk-ci-secret") == CI_KEY
    assert keys.match("sk-ci-secre") is None
    assert keys.match("") is None
    assert "sk-ci-secret" not in repr(vars(keys))


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ApiServer:
    """Answers reviews as a real API server would: by the accounts that exist."""

    accounts: dict[str, Subject] = field(default_factory=dict)
    up: bool = True
    asked: int = 0

    async def review(self, token: str) -> Subject | None:
        self.asked += 1
        if not self.up:
            raise ReviewUnavailable("down")
        return self.accounts.get(token)


def authenticator(server: ApiServer, clock: Clock) -> Authenticator:
    keys = ApiKeys({CI_KEY: "sk-ci-secret"})
    return Authenticator(lambda: keys, server, monotonic=clock, ttl=60, max_stale=600)


async def test_a_token_is_reviewed_once_per_ttl_and_a_deleted_account_is_refused() -> None:
    clock, server = Clock(), ApiServer({TOKEN: Subject.service_account("team-a", "bot")})
    gate = authenticator(server, clock)
    for _ in range(3):
        assert await gate.subject(f"Bearer {TOKEN}") == Subject.service_account("team-a", "bot")
    assert server.asked == 1
    del server.accounts[TOKEN]  # the ServiceAccount is deleted
    clock.now += 59
    await gate.subject(f"Bearer {TOKEN}")  # within the TTL: the verdict stands
    clock.now += 1
    with pytest.raises(ProxyError) as refused:
        await gate.subject(f"Bearer {TOKEN}")
    assert refused.value.status == 401
    assert TOKEN not in refused.value.message


async def test_an_outage_keeps_known_verdicts_and_refuses_unknown_tokens_with_503() -> None:
    clock, server = Clock(), ApiServer({TOKEN: Subject.service_account("team-a", "bot")})
    gate = authenticator(server, clock)
    await gate.subject(f"Bearer {TOKEN}")
    server.up = False
    clock.now += 120
    assert await gate.subject(f"Bearer {TOKEN}") == Subject.service_account("team-a", "bot")
    with pytest.raises(ProxyError) as unknown:
        await gate.subject("Bearer other.token.here")
    assert unknown.value.status == 503
    clock.now += 600  # beyond what an outage may stretch a verdict
    with pytest.raises(ProxyError) as stale:
        await gate.subject(f"Bearer {TOKEN}")
    assert stale.value.status == 503


async def test_api_keys_and_anonymous_callers_need_no_review() -> None:
    clock, server = Clock(), ApiServer()
    gate = authenticator(server, clock)
    assert await gate.subject("Bearer sk-ci-secret") == Subject.api_key(CI_KEY)
    assert await gate.subject(None) is ANONYMOUS
    # An unknown key has the rights of no key at all (AccessGate tells it apart).
    assert await gate.subject("Bearer sk-wrong") == UNKNOWN_KEY
    with pytest.raises(ProxyError) as scheme:
        await gate.subject("Basic dXNlcjpwYXNz")
    assert scheme.value.status == 401
    assert server.asked == 0
