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

from rolegate_policy.config import CompiledGrant, SecretRef

from ..core.access import ANONYMOUS, UNKNOWN_KEY, Grants, Subject, SubjectKind
from ..wire.errors import ProxyError
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

    def __init__(self, reviewer: Reviewer, *, monotonic: Callable[[], float]) -> None:
        self.grants = Grants(())
        self._api_keys = ApiKeys({})
        self.authenticator = Authenticator(lambda: self._api_keys, reviewer, monotonic=monotonic)

    def reload(
        self, grants: Sequence[CompiledGrant], key_for: Callable[[SecretRef], str | None]
    ) -> None:
        self.grants = Grants(grants)
        self._api_keys = known_keys(self.grants.api_keys, key_for)

    def use(self, reviewer: Reviewer) -> None:
        """Verify ServiceAccount tokens with `reviewer` from now on (the cluster's, once
        the proxy has a session to the API server)."""
        self.authenticator.reviewer = reviewer

    async def identify(self, authorization: str | None) -> Subject:
        return await self.authenticator.subject(authorization)

    def authorize(self, subject: Subject, role: str) -> CompiledGrant:
        """The grant admitting `subject` to `role`; raises 401 for an anonymous caller no
        grant admits (without naming any role), 403 for a known one, naming both."""
        grant = self.grants.admitting(subject, role)
        if grant is not None:
            return grant
        if subject == UNKNOWN_KEY:
            raise unauthenticated(
                "The bearer credential is not a known API key (a ServiceAccount token "
                "would be a JWT); check the key, or ask for one to be granted."
            )
        if subject.kind is SubjectKind.ANONYMOUS:
            raise unauthenticated(
                "This proxy needs a credential: send `Authorization: Bearer` with a "
                "ServiceAccount token (audience rolegate) or an API key."
            )
        raise ProxyError(
            403,
            f"{subject.describe()} is not granted role {role}: an AccessGrant listing it "
            f"(or its namespace) with role {role} is needed.",
            error_type="permission_error",
            code="role_not_granted",
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
