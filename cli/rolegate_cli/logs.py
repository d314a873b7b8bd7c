"""How `rolegate` writes its log: `--log-format text` (the default) or `json`.

JSON is one object per line, for log collectors: `time` (RFC 3339, UTC), `level`,
`logger`, `message`, then the record's structured fields (what the code passed in
`extra=`) as top-level keys, e.g. the proxy's access line (request_id, role, provider,
machine, outcome, status, ...). The same formatter serves kopf's records in the operator:
kopf's own logging set-up is never run (`kopf.operator` is called in-process), so its
records reach the root handler like ours, with the resource they concern under `object`.

The standard library only. Lines are ASCII: `json.dumps` escapes every control character
and everything beyond ASCII, so no message can forge a second line, and any stderr
encoding takes them.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from enum import StrEnum
from math import isfinite
from typing import Any, Final, TextIO


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s %(message)s"

# What every LogRecord carries (plus what formatting adds): everything else on a record
# was passed in `extra=` and is a structured field.
_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# kopf's per-object extras: the resource reference (rendered as `object`), whether to
# post an Event, and the operator's settings object (never a log field).
_KOPF_REF: Final = "k8s_ref"
_KOPF_PRIVATE: Final = frozenset({"k8s_ref", "k8s_skip", "settings"})
_REF_KEYS: Final = ("apiVersion", "kind", "namespace", "name", "uid")
_SCALARS: Final = (str, int, float, bool, type(None))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key in _STANDARD or key in _KOPF_PRIVATE or key.startswith("_"):
                continue
            # Scalars only: a stray object's repr could say anything, at any length.
            if isinstance(value, _SCALARS) and key not in entry:
                # NaN and the infinities are not JSON.
                entry[key] = value if not isinstance(value, float) or isfinite(value) else None
        ref = getattr(record, _KOPF_REF, None)
        if isinstance(ref, dict):
            entry["object"] = {key: ref[key] for key in _REF_KEYS if isinstance(ref.get(key), str)}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)


def _rfc3339(created: float) -> str:
    """`2026-12-03T21:01:25.123Z`: milliseconds, UTC, with the Z collectors expect."""
    moment = datetime.fromtimestamp(created, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def configure_logging(level: str, log_format: LogFormat, stream: TextIO | None = None) -> None:
    """The root logger's one handler, to `stream` (stderr) in the chosen format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format is LogFormat.JSON else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
