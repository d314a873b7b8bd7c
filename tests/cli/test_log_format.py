"""`--log-format json`'s formatter: one JSON object per line, the record's fields as keys."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from rolegate_cli.logs import JsonFormatter

RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own writing through the formatter into a buffer."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("rolegate.test.json")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_record_is_one_line_with_time_level_logger_message_and_its_fields(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.info(
        "request id=%s status=%d",
        "abc",
        200,
        extra={"request_id": "abc", "status": 200, "ttft_ms": 12.5, "machine": None},
    )
    [entry] = lines(stream)
    assert RFC3339_UTC.fullmatch(entry.pop("time"))
    assert entry == {
        "level": "INFO",
        "logger": "rolegate.test.json",
        "message": "request id=abc status=200",
        "request_id": "abc",
        "status": 200,
        "ttft_ms": 12.5,
        "machine": None,
    }


def test_a_message_cannot_forge_a_line_and_output_is_ascii(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.warning('two\nlines {"level": "ERROR"} \u2028 café \x1b[31m')
    text = stream.getvalue()
    assert text.isascii()
    [entry] = lines(stream)
    assert entry["message"] == 'two\nlines {"level": "ERROR"} \u2028 café \x1b[31m'
    assert entry["level"] == "WARNING"


def test_only_scalar_fields_are_rendered_and_not_numbers_become_null(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured

    class Secretive:
        def __repr__(self) -> str:
            return "sk-never-this"

    logger.info("x", extra={"thing": Secretive(), "items": ["a"], "nan": float("nan"), "ok": True})
    [entry] = lines(stream)
    assert "thing" not in entry
    assert "items" not in entry
    assert entry["nan"] is None
    assert entry["ok"] is True
    assert "sk-never-this" not in stream.getvalue()


def test_an_exception_is_a_field_of_its_line(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    [entry] = lines(stream)
    assert entry["message"] == "failed"
    assert entry["exception"].startswith("Traceback")
    assert "ValueError: boom" in entry["exception"]


def test_kopfs_object_records_name_their_resource_and_nothing_of_kopf_itself() -> None:
    """kopf's per-object logger (its real class), through the formatter: the resource
    under `object`; its settings object and Event flag are not log fields."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    kopf_logger = logging.getLogger("kopf.objects")
    kopf_logger.addHandler(handler)
    saved = kopf_logger.level, kopf_logger.propagate
    kopf_logger.setLevel(logging.INFO)
    kopf_logger.propagate = False
    try:
        body = kopf.Body(
            {
                "apiVersion": "rolegate.dev/v1alpha1",
                "kind": "RoleTable",
                "metadata": {"name": "roles", "namespace": "team-a", "uid": "u-1"},
            }
        )
        object_logger = kopf.ObjectLogger(body=body, settings=kopf.OperatorSettings())
        object_logger.info("Handler 'x' succeeded.")
    finally:
        kopf_logger.removeHandler(handler)
        kopf_logger.setLevel(saved[0])
        kopf_logger.propagate = saved[1]
    [entry] = lines(stream)
    assert entry["logger"] == "kopf.objects"
    assert entry["message"] == "Handler 'x' succeeded."
    assert entry["object"] == {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "namespace": "team-a",
        "name": "roles",
        "uid": "u-1",
    }
    assert not {"settings", "k8s_ref", "k8s_skip"} & entry.keys()
