"""Who may use which role: the compiled AccessGrants as the request path asks them.

A caller is identified at the edge (a verified ServiceAccount token, an API key matched
by its hash, or nobody) as a `Subject`; `Grants` answers which grants are for it and
whether one admits it to a role. Pure: no I/O, no
clock; built once per configuration, so a request costs a few dictionary lookups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from rolegate_policy.config import CompiledGrant, SecretRef

# A grant's role list may say "every role" (for anonymous local use, and admin grants).
EVERY_ROLE: Final = "*"
# Subjects whose grants are remembered at once (ServiceAccounts of a large cluster).
MAX_REMEMBERED: Final = 10_000


class SubjectKind(StrEnum):
    SERVICE_ACCOUNT = "ServiceAccount"
    API_KEY = "ApiKey"
    ANONYMOUS = "Anonymous"


@dataclass(frozen=True)
class Subject:
    """A caller as identified: never the credential itself."""

    kind: SubjectKind
    # `namespace/name` of a ServiceAccount; `secret/key` of an API key; "" if anonymous.
    name: str = ""

    @classmethod
    def service_account(cls, namespace: str, name: str) -> Subject:
        return cls(SubjectKind.SERVICE_ACCOUNT, f"{namespace}/{name}")

    @classmethod
    def api_key(cls, ref: SecretRef) -> Subject:
        return cls(SubjectKind.API_KEY, f"{ref.name}/{ref.key}")

    @property
    def namespace(self) -> str | None:
        if self.kind is not SubjectKind.SERVICE_ACCOUNT:
            return None
        return self.name.partition("/")[0]

    def describe(self) -> str:
        """How an error message names the caller, at the start of a sentence: a
        ServiceAccount by its name (the caller's own identity, which it needs to ask for a
        grant); an API key never by the Secret holding it, which is the cluster's business,
        not the key holder's."""
        if self.kind is SubjectKind.SERVICE_ACCOUNT:
            return f"ServiceAccount {self.name}"
        if self.kind is SubjectKind.API_KEY:
            return "This API key"
        return "An anonymous caller"


ANONYMOUS: Final = Subject(SubjectKind.ANONYMOUS)
# A caller whose bearer credential is no known API key (nor a token): it has exactly the
# rights of a caller without one (anonymous grants, which anyone has by omitting the
# header), so OpenAI clients that always send some key still reach an anonymous grant;
# when none admits it, it is told its key is unknown.
UNKNOWN_KEY: Final = Subject(SubjectKind.ANONYMOUS, "unknown-key")


class Grants:
    """The compiled grants, indexed by the subjects they name."""

    def __init__(self, grants: Sequence[CompiledGrant]) -> None:
        self._by_account: dict[str, list[CompiledGrant]] = {}
        self._by_namespace: dict[str, list[CompiledGrant]] = {}
        self._by_key: dict[str, list[CompiledGrant]] = {}
        self._anonymous: list[CompiledGrant] = []
        self._of: dict[Subject, tuple[CompiledGrant, ...]] = {}
        self._last_subject: Subject | None = None
        self._last_grants: tuple[CompiledGrant, ...] = ()
        for grant in grants:
            for account in grant.service_accounts:
                self._by_account.setdefault(account, []).append(grant)
            for namespace in grant.namespaces:
                self._by_namespace.setdefault(namespace, []).append(grant)
            for ref in grant.api_keys:
                self._by_key.setdefault(f"{ref.name}/{ref.key}", []).append(grant)
            if grant.anonymous:
                self._anonymous.append(grant)
        self.api_keys: tuple[SecretRef, ...] = tuple(
            sorted({ref for grant in grants for ref in grant.api_keys}, key=_ref_order)
        )

    def of(self, subject: Subject) -> tuple[CompiledGrant, ...]:
        """Every grant for `subject`, in name order. Asked two or three times per request
        (any role at all, this role, admin), so remembered per subject for the life of
        these grants (bounded: forgotten wholesale past `MAX_REMEMBERED`)."""
        if subject is self._last_subject:
            # The same caller as the question before (the anonymous one is one object, and
            # a ServiceAccount's verdict keeps its subject): no hashing of a dataclass.
            return self._last_grants
        found = self._of.get(subject)
        if found is None:
            if len(self._of) >= MAX_REMEMBERED:
                self._of.clear()
            found = self._of[subject] = self._find(subject)
        self._last_subject, self._last_grants = subject, found
        return found

    def _find(self, subject: Subject) -> tuple[CompiledGrant, ...]:
        if subject.kind is SubjectKind.ANONYMOUS:
            found = list(self._anonymous)
        elif subject.kind is SubjectKind.API_KEY:
            found = list(self._by_key.get(subject.name, ()))
        else:
            found = [
                *self._by_account.get(subject.name, ()),
                *self._by_namespace.get(subject.namespace or "", ()),
            ]
        return tuple(sorted({grant.name: grant for grant in found}.values(), key=_by_name))

    def admitting(self, subject: Subject, role: str) -> tuple[CompiledGrant, ...]:
        """Every grant that admits `subject` to `role`, in name order."""
        granted = [g for g in self.of(subject) if role in g.roles or EVERY_ROLE in g.roles]
        return tuple(granted)

    def roles_for(self, subject: Subject, roles: Iterable[str]) -> tuple[str, ...]:
        """Those of `roles` some grant admits `subject` to, in their order."""
        granted = {role for grant in self.of(subject) for role in grant.roles}
        if EVERY_ROLE in granted:
            return tuple(roles)
        return tuple(role for role in roles if role in granted)

    def administers(self, subject: Subject) -> bool:
        """Whether a grant lets `subject` read the proxy's explanations and judge."""
        return any(grant.admin for grant in self.of(subject))


def _ref_order(ref: SecretRef) -> tuple[str, str]:
    return (ref.name, ref.key)


def _by_name(grant: CompiledGrant) -> str:
    return grant.name
