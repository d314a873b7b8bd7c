"""Errors in the OpenAI error shape, each with a message that says what to fix (SPEC E2)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class ProxyError(Exception):
    """A failure we answer the client with; never carries prompt or completion text."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = headers or {}
        # The rest of the request cannot be read (its body is broken): the connection
        # cannot carry another request after this answer.
        self.close_connection = close_connection

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        response = web.Response(
            status=self.status,
            body=json.dumps(self.payload(), ensure_ascii=False).encode("utf-8"),
            content_type="application/json",
            charset="utf-8",
            headers=headers,
        )
        if self.close_connection:
            response.force_close()
        return response


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_request"
) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
