"""The access log: one line per finished request, from its outcome record (SPEC C7).

A consumer of the outcome channel, so the request path never formats or writes a log line:
it only emits the outcome, as it does anyway. Off unless the `rolegate.proxy.access`
logger is enabled for INFO (`--log-level info`); while it is off a batch costs one check.

Routing metadata only, like the record it is made of: names (the role and grant from the
configuration, the provider and model as configured, the machine as `wire.names` made it
safe), the outcome and numbers. Never a prompt, a completion, a credential or an
upstream's error text. The fields ride in `extra=`, so `--log-format json` renders them
as top-level keys; the message says the same for `--log-format text`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..core.outcomes import Outcome

log = logging.getLogger("rolegate.proxy.access")


def log_access(batch: Sequence[Outcome]) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    for outcome in batch:
        fields = access_fields(outcome)
        log.info(
            "request id=%s role=%s provider=%s machine=%s status=%d outcome=%s attempts=%d "
            "ms=%.1f",
            outcome.request_id, outcome.role or "-", outcome.provider or "-",
            outcome.machine or "-", outcome.status, outcome.outcome.value,
            fields["attempts"], fields["total_ms"],
            extra=fields,
        )  # fmt: skip


def access_fields(outcome: Outcome) -> dict[str, object]:
    """The structured fields of a request's access line (None where nothing is known)."""
    ttft = outcome.ttft_seconds
    return {
        "request_id": outcome.request_id,
        "role": outcome.role,
        "ruling": outcome.ruling,
        "grant": outcome.grant,
        "provider": outcome.provider,
        "model": outcome.model,
        "machine": outcome.machine,
        "outcome": outcome.outcome.value,
        "status": outcome.status,
        "stream": outcome.stream,
        "attempts": len(outcome.arms),
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "total_ms": round(outcome.latency_seconds * 1000, 1),
        "tokens_in": outcome.tokens_in,
        "tokens_out": outcome.tokens_out,
        "error_code": outcome.error_code,
        "config_hash": outcome.config_hash,
    }
