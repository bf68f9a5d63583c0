"""Errors the proxy answers with, in OpenAI's error shape."""

from __future__ import annotations

import json

from routing.core import RoutingError


class ProxyError(Exception):
    """A request the proxy answers with an error instead of a backend's reply."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        # Set once the request's usage event holds this error (see ProxyApp).
        self.recorded = False

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> bytes:
    """Serialise ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": error_type,
                "param": param,
                "code": code,
            }
        }
    ).encode()


def bad_request(message: str, *, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


def not_found(path: str, hint: str = "") -> ProxyError:
    return ProxyError(
        404,
        f"Unknown request URL: {path}. Please check the URL.{hint}",
        code="unknown_url",
    )


def method_not_allowed(method: str, path: str) -> ProxyError:
    return ProxyError(
        405,
        f"Method {method} is not allowed for {path}.",
        code="method_not_allowed",
    )


def unauthorized(message: str) -> ProxyError:
    return ProxyError(401, message, code="invalid_api_key")


def routing_error(error: RoutingError) -> ProxyError:
    """The client's answer to a request the router found no backend for."""
    body = error.to_openai()["error"]
    return ProxyError(
        error.status,
        body["message"],
        error_type=body["type"],
        param=body["param"],
        code=body["code"],
    )
