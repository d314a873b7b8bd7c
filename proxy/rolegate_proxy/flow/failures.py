"""What the client is told when no upstream could answer, or one refused the request (SPEC
E2, E6): in our own words, with each upstream's status and error code, never its message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..core.arm_end import ArmEnd, RequestFault
from ..core.choice import Fate, Plan
from ..core.decisions import Decision
from ..core.outcomes import OutcomeKind
from ..core.routing import Candidate
from ..wire.chat_request import ChatRequest
from ..wire.errors import ProxyError


def describe(end: ArmEnd, endpoint: str | None = None) -> str:
    """One failed arm, for a person: where it went and what happened, in our words."""
    where = f" via {end.machine}" if end.machine and end.named else ""
    at = f" ({endpoint})" if endpoint else ""
    return f"{end.provider}{at} for {end.model}{where}: {end.detail}"


def rejected(end: ArmEnd, fault: RequestFault) -> ProxyError:
    """An upstream refused the request itself: the caller gets that back (never resent)."""
    status = end.status or 400
    why = {
        RequestFault.CONTENT_FILTER: "its content filter refused it",
        RequestFault.CONTEXT_LENGTH: "it is too long for the model",
        RequestFault.INVALID: "it says the request is invalid",
    }[fault]
    code = "content_filter" if fault is RequestFault.CONTENT_FILTER else "upstream_rejected"
    detail = f" ({end.error_code})" if end.error_code else ""
    return ProxyError(
        status,
        f"Provider {end.provider!r} rejected the request for model {end.model!r} ({why}): "
        f"HTTP {status}{detail}. It was not retried; change the request.",
        error_type="invalid_request_error",
        code=code,
    )


def refused_for_patience(chat: ChatRequest, plan: Plan, decision: Decision) -> ProxyError | None:
    """An `Only` role none of whose machines may be sent to: 503 at once, naming the role,
    its patience and the fastest machine believed (SPEC B4). None when something other
    than patience refused them all (the usual account of skips says why)."""
    role = chat.role
    slow = [
        (fate.expected_seconds, choice.key(fate.machine).describe())
        for choice in plan.choices
        for fate in choice.fates
        if fate.fate is Fate.PATIENCE and fate.expected_seconds is not None
    ]
    if not slow:
        return None
    decision.outcome = OutcomeKind.FAILED
    seconds, machine = min(slow)
    fastest = (
        f"the fastest believed is {machine}, at about {seconds:.1f} s for "
        f"{role.expected_output_tokens} tokens"
    )
    skipped = decision.skipped_reasons()
    why = f" Skipped: {'; '.join(skipped)}." if skipped else ""
    return ProxyError(
        503,
        f"Role {role.name!r} (ruling Only) has no machine that may answer within its "
        f"patience of {role.patience_seconds:g} s: {fastest}.{why} Raise patienceSeconds, "
        "lower expectedOutputTokens, or use the Order ruling to accept a slow answer.",
        error_type="service_unavailable",
        code="no_machine_within_patience",
    )


def exhausted(
    chat: ChatRequest,
    candidates: Sequence[Candidate],
    failures: Sequence[ArmEnd],
    decision: Decision,
) -> ProxyError:
    """No upstream could serve the role: why, and what to look at."""
    role = chat.role.name
    decision.outcome = OutcomeKind.FAILED
    if not candidates:
        return ProxyError(
            503,
            f"Role {role!r} has no accepted provider serving any of its models "
            f"({', '.join(chat.role.models)}); add or fix a ProviderPolicy that serves one.",
            error_type="service_unavailable",
            code="no_provider",
        )
    skipped = decision.skipped_reasons()
    endpoints = {c.provider.name: c.provider.endpoint for c in candidates}
    tried = (
        "; ".join(describe(e, endpoints.get(e.provider)) for e in failures) or "nothing was sent"
    )
    why = f" Skipped: {'; '.join(skipped)}." if skipped else ""
    if failures and all(end.status == 429 for end in failures):
        waits = [end.retry_after for end in failures if end.retry_after]
        return ProxyError(
            429,
            f"Every upstream for role {role!r} is rate limited: {tried}.{why} "
            "Retry after the time in the Retry-After header.",
            error_type="rate_limit_error",
            code="upstream_rate_limited",
            headers={"Retry-After": str(max(1, math.ceil(min(waits))))} if waits else None,
        )
    if failures and all(end.request_fault is RequestFault.CONTEXT_LENGTH for end in failures):
        return ProxyError(
            400,
            f"The request is too long for every model of role {role!r}: {tried}. "
            "Shorten it, or add a model with a larger context to the role.",
            code="context_length_exceeded",
        )
    return ProxyError(
        502 if failures else 503,
        f"No upstream could serve role {role!r}: {tried}.{why} Check that each "
        "ProviderPolicy endpoint is reachable and its API key is set; tripped "
        "breakers reopen by themselves after their cooldown.",
        error_type="upstream_error",
        code="upstream_unavailable" if failures else "all_candidates_excluded",
    )
