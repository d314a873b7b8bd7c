"""API keys for providers, resolved off the request path.

A ProviderPolicy names a Secret key (`apiKeySecretRef: {name, key}`), never the key
itself. The proxy finds the value, in this order:

1. the environment variable `ROLEGATE_SECRET_<NAME>_<KEY>` (upper-cased, every character
   that is not a letter or digit replaced by `_`), convenient outside a cluster;
2. the file `<secrets dir>/<name>/<key>`, which is how Kubernetes mounts a Secret volume
   (the Helm chart mounts each referenced Secret at `/var/run/secrets/rolegate/<name>`).

Values are read when a configuration is loaded and refreshed in the background, so the
request path never touches the disk. Values are never logged. Whether a provider's key
was found (`resolution`) goes onto the ProviderPolicy's status, never the key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rolegate_policy.config import (
    CompiledProvider,
    ProxyConfig,
    SecretRef,
)
from rolegate_policy.status import KeyResolution

DEFAULT_SECRETS_DIR = Path("/var/run/secrets/rolegate")


def env_var_name(ref: SecretRef) -> str:
    return "ROLEGATE_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", f"{ref.name}_{ref.key}").upper()


@dataclass(frozen=True)
class KeyLookup:
    # Kept out of the repr: a KeyStore (or the state holding it) printed in a log line or
    # a traceback shows where keys are looked for, never a key.
    value: str | None = field(repr=False)
    # Where we looked, for an error message that says what to set; never the value.
    searched: str


@dataclass
class KeyStore:
    secrets_dir: Path = DEFAULT_SECRETS_DIR
    # Out of the repr: the environment holds keys too.
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, repr=False)
    _keys: dict[SecretRef, KeyLookup] = field(default_factory=dict, repr=False)

    def refresh(self, config: ProxyConfig) -> bool:
        """Re-read every key the configuration references (blocking; call off the hot path).
        True when a key was found that was not before, or the other way round."""
        keys: dict[SecretRef, KeyLookup] = {}
        wanted = [provider.api_key_secret_ref for provider in config.providers]
        # The callers' API keys of the access grants too (held as digests by `callers`).
        wanted += [ref for grant in config.grants for ref in grant.api_keys]
        for ref in wanted:
            if ref is not None and ref not in keys:
                keys[ref] = self._lookup(ref)
        previous, self._keys = self._keys, keys
        return any(
            ref not in previous or (previous[ref].value is None) != (found.value is None)
            for ref, found in keys.items()
        )

    def resolution(self, provider: CompiledProvider) -> KeyResolution | None:
        """Whether `provider`'s key was found, from what the last refresh read (no I/O);
        None when that refresh did not look for it (a provider of another configuration)."""
        ref = provider.api_key_secret_ref
        if ref is None:
            return KeyResolution.NOT_REQUIRED
        found = self._keys.get(ref)
        if found is None:
            return None
        return KeyResolution.NOT_FOUND if found.value is None else KeyResolution.RESOLVED

    def key_for(self, ref: SecretRef) -> str | None:
        """The key, from what the last refresh read (the request path's call)."""
        return self.lookup(ref).value

    def where(self, ref: SecretRef) -> str:
        """Where the key is looked for, for an error that says what to set."""
        return self.lookup(ref).searched

    def lookup(self, ref: SecretRef) -> KeyLookup:
        found = self._keys.get(ref)
        if found is None:
            found = self._lookup(ref)
            self._keys[ref] = found
        return found

    def _lookup(self, ref: SecretRef) -> KeyLookup:
        var = env_var_name(ref)
        path = self.secrets_dir / ref.name / ref.key
        searched = f"environment variable {var} or file {path}"
        # An empty value (or only whitespace) is no key: the file is looked at next.
        value = (self.environ.get(var) or "").strip()
        if value:
            return KeyLookup(value, searched)
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError:
            return KeyLookup(None, searched)
        return KeyLookup(text or None, searched)
