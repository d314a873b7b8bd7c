"""compile: RoleTables and ProviderPolicies in, proxy configuration and verdicts out.

`compile_manifests` is a pure, deterministic function: no clock, no I/O, and the same
set of manifests gives a byte-identical configuration (and hash) whatever order they
arrive in. The operator and the standalone proxy both call it (SPEC D2, E3).

The rules, in the order they apply:
1. Each resource is validated on its own. An invalid one is rejected with a verdict
   naming the field and is left out; the rest still compile.
2. ProviderPolicies compile first, then RoleTables against the accepted providers.
3. Names are global: two ProviderPolicies with one name (in any namespaces), or one
   role name in two RoleTables, are duplicates. The first in (namespace, name) order
   wins; the later resource is rejected as `DuplicateName`. Only accepted resources
   claim names, so an invalid resource never blocks a valid one.
4. A role none of whose models an accepted provider serves rejects its RoleTable
   (`NoServedModel`). Unserved models of an otherwise served role are left out of the
   compiled role with a warning, so every model in the configuration has a provider.
5. Output is sorted: providers, roles, provider models and machines by name; a role's
   models keep their declared order, which is the fallback order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from rolegate_policy import GROUP, VERSION
from rolegate_policy.config import (
    CompiledGrant,
    CompiledMachine,
    CompiledModel,
    CompiledProvider,
    CompiledRole,
    ProxyConfig,
    SecretRef,
    with_hash,
)
from rolegate_policy.enums import (
    BypassField,
    Dialect,
)
from rolegate_policy.field_errors import FieldError, shorten, translate
from rolegate_policy.manifests import LoadResult, Manifest, load_manifest_dir
from rolegate_policy.model import (
    ACCESS_GRANT_KIND,
    DNS_SUBDOMAIN_PATTERN,
    PROVIDER_POLICY_KIND,
    ROLE_TABLE_KIND,
    SPEC_MODELS,
    AccessGrantSpec,
    BreakerSpec,
    DegradedOutputSpec,
    ProviderPolicySpec,
    RoleSpec,
    RoleTableSpec,
    TimeoutsSpec,
    parse_spec,
)
from rolegate_policy.report import format_report, format_rulings, render_json
from rolegate_policy.rulings import resolve_delivery, resolve_ruling, seconds
from rolegate_policy.verdicts import (
    AcceptedReason,
    CompileResult,
    EffectiveRuling,
    IgnoredDocument,
    ResourceVerdict,
    join_errors,
)

__all__ = [
    "compile_directory",
    "compile_loaded",
    "compile_manifests",
    "format_report",
    "format_rulings",
    "render_json",
    "run_compile",
]

_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN_PATTERN)


def compile_manifests(manifests: Sequence[Manifest]) -> CompileResult:
    """The proxy configuration compiled from `manifests`, and one verdict per resource.

    Manifests of other API groups are returned as ignored, not judged.
    """
    ordered = sorted(manifests, key=_manifest_order)
    verdicts: list[ResourceVerdict] = []
    ignored: list[IgnoredDocument] = []
    providers_in: list[Manifest] = []
    tables_in: list[Manifest] = []
    grants_in: list[Manifest] = []
    for manifest in ordered:
        if manifest.group != GROUP:
            ignored.append(
                IgnoredDocument(
                    source=manifest.source,
                    api_version=manifest.api_version,
                    kind=manifest.kind,
                    name=manifest.name or None,
                )
            )
            continue
        envelope_errors = _envelope_errors(manifest)
        if envelope_errors:
            verdicts.append(_rejected(manifest, AcceptedReason.INVALID_MANIFEST, envelope_errors))
        elif manifest.kind == PROVIDER_POLICY_KIND:
            providers_in.append(manifest)
        elif manifest.kind == ACCESS_GRANT_KIND:
            grants_in.append(manifest)
        else:
            tables_in.append(manifest)

    providers = _ProviderStage()
    for manifest in providers_in:
        verdicts.append(providers.add(manifest))
    roles = _RoleStage(providers)
    for manifest in tables_in:
        verdicts.append(roles.add(manifest))
    grants = _GrantStage({role.name for role in roles.compiled})
    for manifest in grants_in:
        verdicts.append(grants.add(manifest))

    config = ProxyConfig(
        providers=tuple(sorted(providers.compiled.values(), key=lambda p: p.name)),
        roles=tuple(sorted(roles.compiled, key=lambda r: r.name)),
        grants=tuple(sorted(grants.compiled, key=lambda g: g.name)),
    )
    return CompileResult(
        config=with_hash(config),
        verdicts=tuple(sorted(verdicts, key=ResourceVerdict.sort_key)),
        ignored=tuple(sorted(ignored, key=IgnoredDocument.sort_key)),
    )


def compile_loaded(load: LoadResult) -> CompileResult:
    """`compile_manifests` over a loaded directory, with its load rejections and ignored
    documents folded into the result."""
    result = compile_manifests(load.manifests)
    return result.model_copy(
        update={
            "verdicts": tuple(
                sorted(load.rejected + result.verdicts, key=ResourceVerdict.sort_key)
            ),
            "ignored": tuple(sorted(load.ignored + result.ignored, key=IgnoredDocument.sort_key)),
        }
    )


def compile_directory(path: Path) -> CompileResult:
    """Load every manifest in `path` and compile them: what the standalone proxy runs.

    Raises `FileNotFoundError` / `NotADirectoryError` when `path` is not a directory.
    """
    return compile_loaded(load_manifest_dir(path))


def run_compile(directory: Path, stdout: TextIO, stderr: TextIO, *, rulings: bool = False) -> int:
    """`rolegate compile DIR`: JSON `{config, verdicts, ignored}` on stdout, or with
    `rulings` one plain line per compiled role instead; the human-readable report on
    stderr either way. Exit status 1 when any resource was rejected, when the directory
    is missing, or when it holds no rolegate resource; 0 otherwise.
    """
    try:
        load = load_manifest_dir(directory)
    except OSError as error:
        stderr.write(f"rolegate compile: {error}\n")
        return 1
    result = compile_loaded(load)
    stdout.write(format_rulings(result) if rulings else render_json(result))
    stderr.write(format_report(result))
    if not result.verdicts:
        found = f"{len(load.files)} file(s) read" if load.files else "no *.yaml or *.yml files"
        stderr.write(
            f"rolegate compile: no RoleTable or ProviderPolicy ({GROUP}) found in "
            f"{directory} ({found})\n"
        )
        return 1
    return 0 if result.all_accepted else 1


# Envelope ---------------------------------------------------------------------------


def _manifest_order(manifest: Manifest) -> tuple[str, str, str, str]:
    return (manifest.namespace or "", manifest.name, manifest.kind, manifest.source)


def _envelope_errors(manifest: Manifest) -> list[FieldError]:
    errors: list[FieldError] = []
    if manifest.api_version != f"{GROUP}/{VERSION}":
        errors.append(
            FieldError(
                field="apiVersion",
                message=f"{shorten(manifest.api_version)} is not supported; use {GROUP}/{VERSION}",
            )
        )
    if manifest.kind not in SPEC_MODELS:
        errors.append(
            FieldError(
                field="kind",
                message=(
                    f"{shorten(manifest.kind)} is not a {GROUP} kind; use "
                    f"{ROLE_TABLE_KIND}, {PROVIDER_POLICY_KIND} or {ACCESS_GRANT_KIND}"
                ),
            )
        )
    if len(manifest.name) > 253 or not _DNS_SUBDOMAIN.match(manifest.name):
        errors.append(
            FieldError(
                field="metadata.name",
                message=(
                    "must be a DNS subdomain: at most 253 lower-case letters, digits, '-' "
                    "and '.', starting and ending with a letter or digit"
                ),
            )
        )
    return errors


def _parse(
    manifest: Manifest,
) -> tuple[ProviderPolicySpec | RoleTableSpec | AccessGrantSpec | None, list[FieldError]]:
    try:
        spec = parse_spec(manifest.kind, manifest.spec)
    except ValidationError as error:
        return None, translate(error, SPEC_MODELS[manifest.kind], "spec")
    assert isinstance(spec, ProviderPolicySpec | RoleTableSpec | AccessGrantSpec)
    return spec, []


def _verdict(
    manifest: Manifest,
    *,
    accepted: bool,
    reason: AcceptedReason,
    message: str,
    errors: Sequence[FieldError] = (),
    warnings: Sequence[str] = (),
    rulings: Sequence[EffectiveRuling] = (),
) -> ResourceVerdict:
    return ResourceVerdict(
        source=manifest.source,
        kind=manifest.kind,
        namespace=manifest.namespace,
        name=manifest.name,
        generation=manifest.generation,
        accepted=accepted,
        reason=reason,
        message=message,
        errors=tuple(errors),
        warnings=tuple(warnings),
        effective_rulings=tuple(rulings),
    )


def _rejected(
    manifest: Manifest,
    reason: AcceptedReason,
    errors: Sequence[FieldError],
    warnings: Sequence[str] = (),
    rulings: Sequence[EffectiveRuling] = (),
) -> ResourceVerdict:
    return _verdict(
        manifest,
        accepted=False,
        reason=reason,
        message=join_errors(tuple(errors)),
        errors=errors,
        warnings=warnings,
        rulings=rulings,
    )


def _accepted_message(summary: str, warnings: Sequence[str]) -> str:
    if not warnings:
        return f"Accepted: {summary}."
    count = f"{len(warnings)} warning" + ("s" if len(warnings) > 1 else "")
    return f"Accepted: {summary}; {count}: {warnings[0]}" + ("; …" if len(warnings) > 1 else "")


def _described(other: Manifest) -> str:
    """How a verdict names another resource: `namespace/name`, plus its file if it has one."""
    shown = other.display_name
    return shown if other.source == shown else f"{shown} ({other.source})"


# Providers --------------------------------------------------------------------------


@dataclass
class _ProviderStage:
    compiled: dict[str, CompiledProvider] = field(default_factory=dict)
    claimed_by: dict[str, Manifest] = field(default_factory=dict)

    def add(self, manifest: Manifest) -> ResourceVerdict:
        spec, errors = _parse(manifest)
        if spec is None:
            return _rejected(manifest, AcceptedReason.INVALID_SPEC, errors)
        assert isinstance(spec, ProviderPolicySpec)
        first = self.claimed_by.get(manifest.name)
        if first is not None:
            return _rejected(
                manifest,
                AcceptedReason.DUPLICATE_NAME,
                [
                    FieldError(
                        field="metadata.name",
                        message=(
                            f"ProviderPolicy {_described(first)} already has the name "
                            f"{manifest.name} and comes first in namespace/name order; "
                            "provider names must be unique across namespaces because "
                            "breakers and machines are keyed by them, so rename one"
                        ),
                    )
                ],
            )
        provider = _compile_provider(manifest, spec)
        self.compiled[provider.name] = provider
        self.claimed_by[provider.name] = manifest
        machines = sum(len(model.machines) for model in provider.models)
        summary = (
            f"{_count(len(provider.models), 'model')} on {_count(machines, 'machine')} "
            f"({provider.dialect.value} dialect)"
        )
        return _verdict(
            manifest,
            accepted=True,
            reason=AcceptedReason.ACCEPTED,
            message=_accepted_message(summary, []),
        )

    def serving(self, model: str) -> list[CompiledProvider]:
        return [p for _, p in sorted(self.compiled.items()) if p.model(model) is not None]


def _compile_provider(manifest: Manifest, spec: ProviderPolicySpec) -> CompiledProvider:
    models: list[CompiledModel] = []
    for model in spec.models:
        machines = [
            CompiledMachine(
                name=machine.name,
                ttft_seconds=machine.ttft_seconds,
                tokens_per_second=machine.tokens_per_second,
                price_input_per_mtok=machine.price_input_per_mtok,
                price_output_per_mtok=machine.price_output_per_mtok,
                max_concurrency=machine.max_concurrency,
                continues_partial_message=machine.continues_partial_message,
                echoes_partial_message=machine.echoes_partial_message,
            )
            for machine in model.machines
        ]
        if not machines and spec.dialect is Dialect.OPENAI:
            # A direct endpoint is its own single machine.
            machines = [CompiledMachine(name=manifest.name)]
        models.append(
            CompiledModel(name=model.name, machines=tuple(sorted(machines, key=lambda m: m.name)))
        )
    secret = spec.api_key_secret_ref
    return CompiledProvider(
        name=manifest.name,
        source=manifest.display_name,
        # Stored without a trailing slash so the proxy can append `/chat/completions`.
        endpoint=spec.endpoint.rstrip("/"),
        dialect=spec.dialect,
        api_key_secret_ref=SecretRef(name=secret.name, key=secret.key) if secret else None,
        models=tuple(sorted(models, key=lambda m: m.name)),
        breaker=BreakerSpec(**spec.breaker.model_dump()),
        degraded_output=DegradedOutputSpec(**spec.degraded_output.model_dump()),
        timeouts=TimeoutsSpec(**spec.timeouts.model_dump()),
        propagate_trace_context=spec.propagate_trace_context,
    )


# Roles ------------------------------------------------------------------------------


@dataclass
class _RoleStage:
    providers: _ProviderStage
    compiled: list[CompiledRole] = field(default_factory=list)
    claimed_by: dict[str, Manifest] = field(default_factory=dict)

    def add(self, manifest: Manifest) -> ResourceVerdict:
        spec, errors = _parse(manifest)
        if spec is None:
            return _rejected(manifest, AcceptedReason.INVALID_SPEC, errors)
        assert isinstance(spec, RoleTableSpec)
        rulings = [_effective_ruling(role, spec) for role in spec.roles]

        duplicates = [
            FieldError(
                field=f"spec.roles[{index}].name",
                message=(
                    f"role {role.name} is already defined by RoleTable "
                    f"{_described(self.claimed_by[role.name])}, which comes first in "
                    "namespace/name order; callers select a role by name, so rename it "
                    "here or remove it from one of the tables"
                ),
            )
            for index, role in enumerate(spec.roles)
            if role.name in self.claimed_by
        ]
        if duplicates:
            return _rejected(manifest, AcceptedReason.DUPLICATE_NAME, duplicates, rulings=rulings)

        unserved: list[FieldError] = []
        warnings: list[str] = []
        served_models: list[tuple[str, ...]] = []
        for index, role in enumerate(spec.roles):
            served = tuple(model for model in role.models if self.providers.serving(model))
            served_models.append(served)
            if not served:
                unserved.append(_no_served_model(index, role))
                continue
            warnings.extend(
                f"spec.roles[{index}].models[{position}]: {shorten(model)} is not served by "
                f"any accepted ProviderPolicy; role {role.name} skips it until one does"
                for position, model in enumerate(role.models)
                if model not in served
            )
            warnings.extend(self._patience_warnings(index, role, served))
        if unserved:
            return _rejected(
                manifest,
                AcceptedReason.NO_SERVED_MODEL,
                unserved,
                warnings=warnings,
                rulings=rulings,
            )

        for role, served, ruling in zip(spec.roles, served_models, rulings, strict=True):
            self.compiled.append(
                CompiledRole(
                    name=role.name,
                    source=manifest.display_name,
                    models=served,
                    patience_seconds=role.patience_seconds,
                    visibility=role.visibility,
                    ruling=role.ruling,
                    effective_ruling=ruling.effective,
                    ruling_reason=ruling.reason,
                    expected_output_tokens=role.expected_output_tokens,
                    quality_tolerance=role.quality_tolerance,
                    speed_tolerance=role.speed_tolerance,
                    exploration_share=role.exploration_share,
                    delivery=ruling.delivery,
                    retry=role.retry,
                    caller_may_bypass=tuple(f for f in BypassField if f in role.caller_may_bypass),
                )
            )
            self.claimed_by[role.name] = manifest
        summary = (
            f"{_count(len(spec.roles), 'role')} ("
            + ", ".join(
                f"{ruling.role} → {ruling.effective.value}, {ruling.delivery.value}"
                for ruling in rulings
            )
            + ")"
        )
        return _verdict(
            manifest,
            accepted=True,
            reason=AcceptedReason.ACCEPTED,
            message=_accepted_message(summary, warnings),
            warnings=warnings,
            rulings=rulings,
        )

    def _patience_warnings(self, index: int, role: RoleSpec, served: tuple[str, ...]) -> list[str]:
        """Warn when the published figures say no machine can meet the role's patience.

        Only when every candidate publishes both figures: a machine without them is
        unknown, and an unknown machine may well be fast.
        """
        fastest: tuple[float, str] | None = None
        for model in served:
            for provider in self.providers.serving(model):
                compiled = provider.model(model)
                assert compiled is not None
                for machine in compiled.machines:
                    if machine.ttft_seconds is None or machine.tokens_per_second is None:
                        return []
                    expected = (
                        machine.ttft_seconds
                        + role.expected_output_tokens / machine.tokens_per_second
                    )
                    label = f"{machine.name} serving {shorten(model)} at {provider.name}"
                    if fastest is None or (expected, label) < fastest:
                        fastest = (expected, label)
        if fastest is None or fastest[0] <= role.patience_seconds:
            return []
        return [
            f"spec.roles[{index}].patienceSeconds: by their published figures no machine "
            f"answers role {role.name} within {seconds(role.patience_seconds)} (fastest: "
            f"{fastest[1]}, about {fastest[0]:.1f}s for {role.expected_output_tokens} tokens); "
            "the proxy refuses them all until it measures better, so raise "
            "patienceSeconds or lower expectedOutputTokens"
        ]


def _effective_ruling(role: RoleSpec, spec: RoleTableSpec) -> EffectiveRuling:
    effective, reason = resolve_ruling(
        role.ruling, role.visibility, role.patience_seconds, spec.auto_only_below_seconds
    )
    delivery, delivery_reason = resolve_delivery(role.delivery, role.visibility)
    return EffectiveRuling(
        role=role.name, declared=role.ruling, effective=effective, reason=reason,
        declared_delivery=role.delivery, delivery=delivery, delivery_reason=delivery_reason,
    )  # fmt: skip


def _no_served_model(index: int, role: RoleSpec) -> FieldError:
    names = ", ".join(shorten(model) for model in role.models)
    return FieldError(
        field=f"spec.roles[{index}].models",
        message=(
            f"role {role.name}: none of its models ({names}) is served by an accepted "
            "ProviderPolicy; add a ProviderPolicy serving one of them, or fix the model "
            "names to match one that does"
        ),
    )


def _grant_summary(subjects: int, spec: AccessGrantSpec) -> str:
    """What an accepted grant gives, for its Accepted condition's message."""
    gives = [f"roles {', '.join(spec.roles)}"] if spec.roles else []
    if spec.admin:
        gives.append("admin")
    summary = f"{_count(subjects, 'subject')} granted {' and '.join(gives)}"
    limits = spec.limits
    if limits is not None:
        figures = [
            f"{limits.requests_per_minute} requests/min" if limits.requests_per_minute else "",
            f"{limits.tokens_per_minute} tokens/min" if limits.tokens_per_minute else "",
            f"{limits.cost_per_day_usd:g} USD/day" if limits.cost_per_day_usd else "",
        ]
        summary += f", limited to {', '.join(f for f in figures if f)} per proxy pod"
    return summary


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


# Access grants ------------------------------------------------------------------------


@dataclass
class _GrantStage:
    """AccessGrants, judged against the roles compiled: a grant may name only roles an
    accepted RoleTable defines (a typo would silently grant nothing)."""

    roles: set[str]
    compiled: list[CompiledGrant] = field(default_factory=list)

    def add(self, manifest: Manifest) -> ResourceVerdict:
        spec, errors = _parse(manifest)
        if spec is None:
            return _rejected(manifest, AcceptedReason.INVALID_SPEC, errors)
        assert isinstance(spec, AccessGrantSpec)
        unknown = [
            FieldError(
                field=f"spec.roles[{index}]",
                message=(
                    f"role {role} is not defined by any accepted RoleTable; fix the name, or "
                    "define the role first"
                ),
            )
            for index, role in enumerate(spec.roles)
            if role != "*" and role not in self.roles
        ]
        if unknown:
            return _rejected(manifest, AcceptedReason.UNKNOWN_ROLE, unknown)
        namespace = manifest.namespace or ""
        subjects, limits = spec.subjects, spec.limits
        self.compiled.append(
            CompiledGrant(
                name=f"{namespace}/{manifest.name}",
                source=manifest.display_name,
                roles=tuple(sorted(set(spec.roles))),
                service_accounts=tuple(
                    sorted(
                        {
                            f"{s.service_account.namespace or namespace}/{s.service_account.name}"
                            for s in subjects
                            if s.service_account is not None
                        }
                    )
                ),
                namespaces=tuple(sorted({s.namespace for s in subjects if s.namespace})),
                api_keys=tuple(
                    sorted(
                        {
                            SecretRef(name=s.api_key_secret_ref.name, key=s.api_key_secret_ref.key)
                            for s in subjects
                            if s.api_key_secret_ref is not None
                        },
                        key=lambda ref: (ref.name, ref.key),
                    )
                ),
                anonymous=any(s.anonymous for s in subjects),
                requests_per_minute=limits.requests_per_minute if limits else None,
                tokens_per_minute=limits.tokens_per_minute if limits else None,
                cost_per_day_usd=limits.cost_per_day_usd if limits else None,
                admin=spec.admin,
            )
        )
        summary = _grant_summary(len(subjects), spec)
        return _verdict(
            manifest,
            accepted=True,
            reason=AcceptedReason.ACCEPTED,
            message=_accepted_message(summary, ()),
        )
