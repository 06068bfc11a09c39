"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, one line each."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(error_body(self.status, self.message, self.param, self.code)),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }
