"""Standalone mode (SPEC E3): the proxy's configuration from a directory of manifests.

The same YAML a user would `kubectl apply`, compiled by the same code as the operator.
Rejected resources are reported and left out; the proxy starts on the rest, and refuses
to start only when no role at all was accepted (it could serve nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from rolegate_policy.compile import compile_directory
from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.report import format_report


class StandaloneConfigError(Exception):
    pass


def load_standalone_config(directory: Path, report: TextIO) -> ProxyConfig:
    try:
        result = compile_directory(directory)
    except OSError as error:
        raise StandaloneConfigError(
            f"cannot read manifests from {directory}: {error}; pass --manifests a directory "
            "of RoleTable and ProviderPolicy YAML files"
        ) from None
    print(format_report(result), file=report)
    if not result.config.roles:
        raise StandaloneConfigError(
            f"no role was accepted from {directory}: fix the rejected resources reported "
            "above, or add a RoleTable whose models an accepted ProviderPolicy serves"
        )
    return result.config
