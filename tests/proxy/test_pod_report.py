"""A proxy pod's report on a ProviderPolicy, in parts: whether it could read the API key
(`KeyStore.resolution`, from real files and an environment), the served configuration's
hash, what makes a report go out at once (its digest), and how errors on the way to the
API server read in a log line. The whole path against the real API server is in
tests/k8s/test_pod_report.py."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from rolegate_cli.controlplane import free_port
from rolegate_policy.config import CompiledProvider, ProxyConfig
from rolegate_policy.status import CONFIG_HASH_PATTERN, KeyResolution, PodReport
from rolegate_proxy.edge.credentials import KeyStore, env_var_name
from rolegate_proxy.edge.kube_api import KubeApiError, describe_error
from rolegate_proxy.edge.status_reporter import BreakerReporter, report_digest

from ..support import compile_objects, provider_policy, role, role_table

MODEL = "vendor/model-a"
SECRET = {"name": "router-key", "key": "apiKey"}


def _config(
    *, secret: dict[str, str] | None = SECRET, roles: tuple[str, ...] = ("agent",)
) -> ProxyConfig:
    spec: dict[str, Any] = {"apiKeySecretRef": secret} if secret else {}
    return compile_objects(
        [
            provider_policy("router", "http://127.0.0.1:9/v1", {MODEL: ["m1"]}, **spec),
            role_table(*(role(name, [MODEL]) for name in roles)),
        ]
    )


def _provider(config: ProxyConfig) -> CompiledProvider:
    return config.providers[0]


def _key_file(secrets: Path, text: str) -> Path:
    path = secrets / SECRET["name"] / SECRET["key"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- KeyStore.resolution ---------------------------------------------------------------


def test_a_provider_without_a_secret_ref_needs_no_key(tmp_path: Path) -> None:
    config = _config(secret=None)
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    assert keys.resolution(_provider(config)) is KeyResolution.NOT_REQUIRED


def test_a_key_neither_mounted_nor_in_the_environment_is_not_found(tmp_path: Path) -> None:
    config = _config()
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    assert keys.resolution(_provider(config)) is KeyResolution.NOT_FOUND
    ref = _provider(config).api_key_secret_ref
    assert ref is not None
    assert keys.key_for(ref) is None


@pytest.mark.parametrize("text", ["", "  \n"])
def test_an_empty_key_file_is_not_found(tmp_path: Path, text: str) -> None:
    config = _config()
    _key_file(tmp_path, text)
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    assert keys.resolution(_provider(config)) is KeyResolution.NOT_FOUND


def test_a_mounted_key_resolves(tmp_path: Path) -> None:
    config = _config()
    _key_file(tmp_path, "sk-file\n")
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    assert keys.resolution(_provider(config)) is KeyResolution.RESOLVED


def test_a_key_in_the_environment_resolves_and_a_blank_one_falls_back_to_the_file(
    tmp_path: Path,
) -> None:
    config = _config()
    ref = _provider(config).api_key_secret_ref
    assert ref is not None
    var = env_var_name(ref)
    keys = KeyStore(secrets_dir=tmp_path, environ={var: "sk-env"})
    keys.refresh(config)
    assert keys.resolution(_provider(config)) is KeyResolution.RESOLVED
    assert "sk-env" not in f"{keys!r} {keys.lookup(ref)!r}"  # a traceback shows no key

    blank = KeyStore(secrets_dir=tmp_path, environ={var: "   "})
    blank.refresh(config)
    assert blank.resolution(_provider(config)) is KeyResolution.NOT_FOUND
    assert blank.key_for(ref) is None
    _key_file(tmp_path, "sk-file")
    blank.refresh(config)
    assert blank.key_for(ref) == "sk-file"


def test_resolution_reads_nothing_and_a_refresh_says_when_it_changed(tmp_path: Path) -> None:
    config = _config()
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    # Never refreshed for this configuration: unknown, and nothing is read to find out.
    assert keys.resolution(_provider(config)) is None
    assert keys.refresh(config) is True  # first read
    assert keys.refresh(config) is False  # still not found: nothing to report
    path = _key_file(tmp_path, "sk-one")
    assert keys.resolution(_provider(config)) is KeyResolution.NOT_FOUND  # until a refresh
    assert keys.refresh(config) is True
    assert keys.resolution(_provider(config)) is KeyResolution.RESOLVED
    path.write_text("sk-two", encoding="utf-8")
    assert keys.refresh(config) is False  # a rotated key is still a resolved key
    path.unlink()
    assert keys.refresh(config) is True
    assert keys.resolution(_provider(config)) is KeyResolution.NOT_FOUND


# --- the report ------------------------------------------------------------------------


def _reporter(config: ProxyConfig, keys: KeyStore) -> BreakerReporter:
    return BreakerReporter(
        snapshot=list,
        config=lambda: config,
        monotonic=lambda: 100.0,
        pod="proxy-a",
        key_resolution=keys.resolution,
    )


def test_the_report_carries_the_served_hash_and_the_key_resolution(tmp_path: Path) -> None:
    config = _config()
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    reporter = _reporter(config, keys)
    report = reporter.report(_provider(config), config, [], 100.0, 1_700_000_000.0)
    assert report.served_hash == config.hash
    assert report.api_key is KeyResolution.NOT_FOUND
    wire = report.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert wire["servedHash"] == config.hash
    assert wire["apiKey"] == "NotFound"
    # Read back as the operator reads it.
    assert PodReport.model_validate(wire) == report


def test_what_the_pod_serves_and_finds_is_sent_at_once_times_alone_are_not(
    tmp_path: Path,
) -> None:
    config = _config()
    keys = KeyStore(secrets_dir=tmp_path, environ={})
    keys.refresh(config)
    reporter = _reporter(config, keys)

    def digest(config: ProxyConfig, wall: float = 1_700_000_000.0) -> str:
        return report_digest(reporter.report(_provider(config), config, [], 100.0, wall))

    first = digest(config)
    assert digest(config, wall=1_700_000_100.0) == first  # a heartbeat, not a change
    _key_file(tmp_path, "sk-late")
    keys.refresh(config)
    found = digest(config)
    assert found != first  # the key was found
    changed = _config(roles=("agent", "batch"))
    keys.refresh(changed)
    assert changed.hash != config.hash
    assert digest(changed) != found  # a new configuration served


def test_a_served_hash_must_be_a_config_hash() -> None:
    base = {"pod": "proxy-a", "observedAt": "2026-01-01T00:00:00Z"}
    assert PodReport.model_validate({**base, "servedHash": "sha256:" + "0" * 64}).served_hash
    with pytest.raises(ValidationError):
        PodReport.model_validate({**base, "servedHash": "sha256:XYZ"})
    with pytest.raises(ValidationError):
        PodReport.model_validate({**base, "apiKey": "Missing"})
    assert CONFIG_HASH_PATTERN.startswith("^sha256:")


# --- errors on the way to the API server -------------------------------------------------


async def test_a_refused_connection_reads_as_type_address_and_reason() -> None:
    port = free_port()  # nothing listens there
    context = ssl.create_default_context()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as caught:
            await session.get(f"https://127.0.0.1:{port}/api", ssl=context)
    error = caught.value
    assert "object at 0x" in str(error)  # what aiohttp's own text would have logged
    text = describe_error(error)
    assert "object at 0x" not in text
    assert text == (
        f"ClientConnectorError connecting to 127.0.0.1:{port}: ECONNREFUSED (Connection refused)"
    )


async def test_timeouts_and_unforeseen_errors_read_without_object_reprs() -> None:
    assert describe_error(TimeoutError()) == "TimeoutError"
    assert describe_error(FileNotFoundError(2, "No such file or directory")) == (
        "FileNotFoundError: ENOENT (No such file or directory)"
    )
    odd = RuntimeError(f"broken by {object()!r}\nsecond line")
    assert describe_error(odd) == "RuntimeError: broken by <object> second line"


def test_api_errors_carry_the_status_never_a_body_that_is_not_a_status() -> None:
    status = (
        '{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden",'
        '"message":"providerpolicies.rolegate.dev \\"router\\" is forbidden","code":403}'
    )
    error = KubeApiError.from_body(403, status)
    assert describe_error(error) == (
        'KubeApiError: HTTP 403 Forbidden: providerpolicies.rolegate.dev "router" is forbidden'
    )
    page = KubeApiError.from_body(502, "<html>upstream proxy says: secret stuff</html>")
    assert describe_error(page) == "KubeApiError: HTTP 502"
