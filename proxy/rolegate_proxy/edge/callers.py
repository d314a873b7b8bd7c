"""Identifying a caller from `Authorization: Bearer`, at the edge.

Three ways, tried in this order:

1. **An API key** of a grant's `apiKeySecretRef`: the keys are read off the request path
   (as the providers' keys are) and held only as SHA-256 digests; a presented token is
   hashed and compared with every digest in constant time (`hmac.compare_digest`), so
   neither the time nor the memory says which key, or how much of one, matched.
2. **A ServiceAccount token** (a JWT with audience `rolegate`): verified by the API
   server with a TokenReview. Verdicts are cached by the token's digest (never the token)
   in a bounded LRU for `ttl` seconds: a token's first call waits for its review, later
   calls cost a lookup. A verdict past its TTL is reviewed again; while the API server
   cannot be reached, a verdict up to `max_stale` old is still served (D6: routing goes
   on), and a token never seen is refused with a 503 saying so.
3. **Nobody**: no `Authorization` header at all; admitted only by a grant with an
   anonymous subject.

Nothing here logs or stores a credential.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import hdrs

from rolegate_policy.config import CompiledGrant, ProxyConfig, SecretRef

from ..core.access import ANONYMOUS, UNKNOWN_KEY, Grants, Subject, SubjectKind
from ..core.allowance import LIMIT_FIELDS, Allowances, Limited
from ..core.outcomes import Outcome
from ..wire.errors import ProxyError
from .headers import readable
from .kube_api import KubeAccess, describe_error, load_access

log = logging.getLogger("rolegate.proxy.callers")

TOKEN_AUDIENCE: Final = "rolegate"
SERVICE_ACCOUNT_PREFIX: Final = "system:serviceaccount:"
BEARER: Final = "bearer "


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


class ApiKeys:
    """The grants' API keys, as digests only."""

    def __init__(self, keys: Mapping[SecretRef, str | None]) -> None:
        self._digests: tuple[tuple[bytes, SecretRef], ...] = tuple(
            (digest(value), ref) for ref, value in keys.items() if value
        )

    def match(self, token: str) -> SecretRef | None:
        """The key's reference when `token` is one of the keys; every digest is compared,
        whatever matched first."""
        presented = digest(token)
        found: SecretRef | None = None
        for known, ref in self._digests:
            if hmac.compare_digest(known, presented) and found is None:
                found = ref
        return found


class ReviewUnavailable(RuntimeError):
    """The API server could not be asked (down, or no cluster at all)."""


class Reviewer(Protocol):
    """Asks the API server about a token: the ServiceAccount it belongs to, or None when
    the token is not valid for audience `rolegate` (expired, forged, of a deleted
    account, or for another audience). Raises `ReviewUnavailable`."""

    async def review(self, token: str) -> Subject | None: ...


def subject_of_review(status: Mapping[str, Any]) -> Subject | None:
    """A TokenReview's `status` as a subject: only an authenticated ServiceAccount whose
    token names our audience counts."""
    if status.get("authenticated") is not True:
        return None
    audiences = status.get("audiences") or ()
    if TOKEN_AUDIENCE not in audiences:
        return None
    user = status.get("user") or {}
    username = str(user.get("username") or "")
    if not username.startswith(SERVICE_ACCOUNT_PREFIX):
        return None
    namespace, _, name = username[len(SERVICE_ACCOUNT_PREFIX) :].partition(":")
    if not namespace or not name:
        return None
    return Subject.service_account(namespace, name)


def token_review_body(token: str) -> dict[str, Any]:
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token, "audiences": [TOKEN_AUDIENCE]},
    }


@dataclass(frozen=True)
class Verdict:
    subject: Subject | None  # None: the token is not valid
    at: float  # monotonic, when the API server said so


class VerdictCache:
    """Reviews by token digest: bounded, least recently used out first."""

    def __init__(self, *, size: int = 10_000) -> None:
        self._size = size
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()

    def get(self, key: bytes) -> Verdict | None:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    def put(self, key: bytes, verdict: Verdict) -> None:
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self._size:
            self._verdicts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._verdicts)


def unauthenticated(message: str) -> ProxyError:
    return ProxyError(401, message, code="invalid_api_key", error_type="authentication_error")


class Authenticator:
    def __init__(
        self,
        api_keys: Callable[[], ApiKeys],
        reviewer: Reviewer,
        *,
        monotonic: Callable[[], float],
        ttl: float = 60.0,
        max_stale: float = 600.0,
        cache: VerdictCache | None = None,
    ) -> None:
        self._api_keys = api_keys
        self.reviewer = reviewer
        self._monotonic = monotonic
        self._ttl = ttl
        self._max_stale = max_stale
        self._cache = cache if cache is not None else VerdictCache()

    async def subject(self, authorization: str | None) -> Subject:
        """Who is calling. Raises a 401 `ProxyError` for a credential that is not valid,
        a 503 one while a never-seen token cannot be checked."""
        authorization = readable(authorization, hdrs.AUTHORIZATION)
        if authorization is None:
            return ANONYMOUS
        if not authorization[: len(BEARER)].lower() == BEARER:
            raise unauthenticated(
                "The Authorization header must be `Bearer <credential>`: a ServiceAccount "
                "token with audience rolegate, or an API key."
            )
        token = authorization[len(BEARER) :].strip()
        ref = self._api_keys().match(token)
        if ref is not None:
            return Subject.api_key(ref)
        if token.count(".") != 2:
            return UNKNOWN_KEY  # refused by `AccessGate.authorize` unless anonymous may
        return await self._service_account(token)

    async def _service_account(self, token: str) -> Subject:
        key = digest(token)
        now = self._monotonic()
        known = self._cache.get(key)
        if known is None or now - known.at >= self._ttl:
            try:
                subject = await self.reviewer.review(token)
            except ReviewUnavailable:
                if known is None or now - known.at >= self._max_stale:
                    raise ProxyError(
                        503,
                        "The ServiceAccount token cannot be verified right now (the "
                        "Kubernetes API server does not answer); retry shortly.",
                        code="credentials_unverifiable",
                    ) from None
                # The API server is away: what it said last still holds (D6).
                subject = known.subject
            else:
                known = Verdict(subject, now)
                self._cache.put(key, known)
        else:
            subject = known.subject
        if subject is None:
            raise unauthenticated(
                "The ServiceAccount token was not accepted: it is expired, of a deleted "
                "account, or not for audience rolegate (project it with `audience: "
                "rolegate`)."
            )
        return subject


def known_keys(refs: Sequence[SecretRef], lookup: Callable[[SecretRef], str | None]) -> ApiKeys:
    """The grants' keys as the key store last read them."""
    return ApiKeys({ref: lookup(ref) for ref in refs})


class KubeReviewer:
    """TokenReviews through the API server the proxy already talks to (its ConfigMap
    watch and status reports), with the proxy's own credentials; the chart grants it
    `create` on `tokenreviews` and nothing more about authentication."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        access: Callable[[], Awaitable[KubeAccess]],
        *,
        timeout: float = 5.0,
    ) -> None:
        self._session = session
        self._access = access
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def review(self, token: str) -> Subject | None:
        try:
            access = await self._access()
            async with self._session.post(
                f"{access.base_url}/apis/authentication.k8s.io/v1/tokenreviews",
                data=json.dumps(token_review_body(token)),
                headers={**access.headers, "Content-Type": "application/json"},
                ssl=access.ssl_context,
                timeout=self._timeout,
            ) as response:
                if response.status >= 500 or response.status in (401, 403, 429):
                    # Not a verdict on the token: the API server (or our right to ask it).
                    log.warning("token review unavailable status=%d", response.status)
                    raise ReviewUnavailable(f"HTTP {response.status}")
                if response.status >= 400:
                    return None
                answer = await response.json()
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("token review unavailable error=%s", describe_error(error))
            raise ReviewUnavailable(type(error).__name__) from None
        status = answer.get("status") if isinstance(answer, Mapping) else None
        return subject_of_review(status if isinstance(status, Mapping) else {})


class NoCluster:
    """The reviewer of a proxy outside a cluster (standalone): no API server to ask, so a
    ServiceAccount token is no credential there."""

    async def review(self, token: str) -> Subject | None:
        return None


class AccessGate:
    """The request path's two questions: who is calling (`identify`, before the request is
    read), and may they use this role (`authorize`). Rebuilt, off the request path, on
    every configuration swap and key refresh."""

    def __init__(
        self, reviewer: Reviewer, *, monotonic: Callable[[], float], ttl: float = 60.0
    ) -> None:
        self.grants = Grants(())
        self.allowances = Allowances()
        self._api_keys = ApiKeys({})
        self._monotonic = monotonic
        self.authenticator = Authenticator(
            lambda: self._api_keys,
            reviewer,
            monotonic=monotonic,
            ttl=ttl,
            max_stale=max(600.0, 10 * ttl),
        )

    def reload(
        self, grants: Sequence[CompiledGrant], key_for: Callable[[SecretRef], str | None]
    ) -> None:
        self.grants = Grants(grants)
        self.allowances.configure(grants, self._monotonic())
        self._api_keys = known_keys(self.grants.api_keys, key_for)

    def use(self, reviewer: Reviewer) -> None:
        """Verify ServiceAccount tokens with `reviewer` from now on (the cluster's, once
        the proxy has a session to the API server)."""
        self.authenticator.reviewer = reviewer

    async def identify(self, authorization: str | None) -> Subject:
        return await self.authenticator.subject(authorization)

    def authorize(self, subject: Subject, role: str) -> Admission | None:
        """The grant admitting `subject` to `role`, and whether its limits refuse the
        request now; None when no grant admits it. When several grants admit it, the first
        (in name order) with room left is charged.

        None, not an error of its own: the caller answers a role it may not use exactly as
        a role that does not exist (edge/calls.py), so that a caller cannot learn which
        roles exist by asking for them."""
        grants = self.grants.admitting(subject, role)
        if not grants:
            return None
        now = self._monotonic()
        refusal: Limited | None = None
        for grant in grants:
            limited = self.allowances.admit(grant.name, now)
            if limited is None:
                return Admission(grant, None)
            if refusal is None or limited.retry_after < refusal.retry_after:
                refusal = limited
        assert refusal is not None
        return Admission(next(g for g in grants if g.name == refusal.grant), refusal)

    def may_use_some_role(self, subject: Subject) -> None:
        """Raises 401 (anonymous) or 403 (known) when no grant gives `subject` a role:
        before a caller without rights learns anything about the roles."""
        for grant in self.grants.of(subject):
            if grant.roles:
                return
        raise not_admitted(subject, "is granted no role", "with a role")

    def roles_of(self, subject: Subject, config: ProxyConfig) -> tuple[str, ...]:
        """The roles `subject` may use: all that its errors and `/v1/models` may name."""
        return self.grants.roles_for(subject, (role.name for role in config.roles))

    def charge(self, outcome: Outcome) -> None:
        """Take what a finished request used from its grant's allowance."""
        if outcome.grant is not None and (outcome.tokens or outcome.cost_usd):
            self.allowances.charge(
                outcome.grant, outcome.tokens, outcome.cost_usd or 0.0, self._monotonic()
            )

    async def administrator(self, authorization: str | None, admin_token: str | None) -> None:
        """Admits a caller to the admin endpoints: one presenting the proxy's admin token, or
        one a grant with `admin: true` is for. Raises 401/403 otherwise (and the 401/503 of
        an invalid or unverifiable credential)."""
        authorization = readable(authorization, hdrs.AUTHORIZATION)
        if admin_token and authorization is not None:
            presented = authorization.encode()
            if hmac.compare_digest(presented, f"Bearer {admin_token}".encode()):
                return
        subject = await self.identify(authorization)
        if not self.grants.administers(subject):
            raise not_admitted(
                subject, "may not administer this proxy", "with `admin: true`", admin=True
            )


# Not frozen: one is made for every request (a frozen dataclass sets each field through
# object.__setattr__). Nothing changes one once made: hashed as if frozen.
@dataclass(slots=True, unsafe_hash=True)
class Admission:
    """The grant a request is counted against, and the limit refusing it now, if any."""

    grant: CompiledGrant
    limited: Limited | None


def not_admitted(subject: Subject, what: str, needed: str, *, admin: bool = False) -> ProxyError:
    """401 for a caller without a known credential (which roles exist is not its business),
    403 for a known one, naming what it lacks and the caller as it knows itself (a
    ServiceAccount by name, an API key never by its Secret)."""
    how = (
        "the proxy's admin token (--admin-token-file), or a ServiceAccount token (audience "
        "rolegate) or API key of an AccessGrant with `admin: true`"
        if admin
        else "a ServiceAccount token (audience rolegate) or an API key"
    )
    if subject == UNKNOWN_KEY:
        return unauthenticated(
            "The bearer credential is not a known API key (a ServiceAccount token would be "
            f"a JWT); send {how}."
        )
    if subject.kind is SubjectKind.ANONYMOUS:
        return unauthenticated(f"This needs a credential: send `Authorization: Bearer` with {how}.")
    listing = (
        "it (or its namespace)" if subject.kind is SubjectKind.SERVICE_ACCOUNT else "its Secret"
    )
    return ProxyError(
        403,
        f"{subject.describe()} {what}: an AccessGrant listing {listing} {needed} is needed.",
        error_type="permission_error",
        code="admin_not_granted" if admin else "role_not_granted",
    )


class OverLimit(ProxyError):
    """A request refused by its grant's limits: the caller's doing, not an upstream's (its
    outcome is `rejected`, where an upstream's 429 is `failed`)."""


def rate_limited(limited: Limited) -> OverLimit:
    """429 in OpenAI's shape (`rate_limit_exceeded`), with Retry-After."""
    field, unit = LIMIT_FIELDS[limited.kind]
    return OverLimit(
        429,
        f"AccessGrant {limited.grant} allows {limited.figure:g} {unit} on this proxy and "
        f"they are used up; retry after {limited.retry_after_header} s, or raise its "
        f"spec.limits.{field}.",
        error_type=limited.kind.value,
        code="rate_limit_exceeded",
        headers={"Retry-After": limited.retry_after_header},
    )


def cached_access(
    kubeconfig: Path | None, *, refresh_seconds: float = 60.0
) -> Callable[[], Awaitable[KubeAccess]]:
    """The API server's address and credentials for TokenReviews, re-read (in a worker
    thread) at most once a `refresh_seconds`, so rotated tokens are picked up without a
    file read per review."""
    held: list[tuple[float, KubeAccess]] = []

    async def access() -> KubeAccess:
        now = time.monotonic()
        if not held or now - held[0][0] >= refresh_seconds:
            loaded = await asyncio.to_thread(load_access, kubeconfig)
            held[:] = [(now, loaded)]
        return held[0][1]

    return access
