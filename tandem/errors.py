"""The OpenAI-style error contract shared by workers and routers.

Every refusal is a JSON body {"error": {"message", "type", "param", "code"}} with the right
HTTP status, so the official SDKs raise their typed exceptions (BadRequestError, ...).
"""

from __future__ import annotations

import json
import math
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer (nobody reads it)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client caused or must handle; carries its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_param(loc) -> str | None:
    """The parameter a pydantic error's location names, as a client wrote it: `messages.0.content`, without the
    union member pydantic tried (`str`, `list[int]`, `ContentPart`) or FastAPI's `body` prefix."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p == "body" or _is_type_tag(p)))]
    return ".".join(parts) or None


def _is_type_tag(part: str) -> bool:
    # Parameters are snake_case; pydantic names a union's members by type: builtins, generics, class names.
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none") or part[:1].isupper()


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param,
                      "code": code or HTTPStatus(status).phrase.lower().replace(" ", "_")}}


async def send_error(send, status: int, message: str) -> None:
    """An OpenAI-style JSON error straight to an ASGI `send`, for middleware that answers before the app runs."""
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def pydantic_message(error: dict) -> str:
    """A pydantic error's message, without the "Value error, " pydantic puts before our validators' own."""
    return error["msg"].removeprefix("Value error, ")


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header for a wait of `seconds`: whole seconds, at least one."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error of a request body as an OpenAI-style 400 naming the parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = error_param(first.get("loc", ()))
    message = pydantic_message(first) if "msg" in first else "invalid request"
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {message}"
    elif param is None and first.get("type") in ("model_type", "model_attributes_type", "dict_type", "missing"):
        message = "request body must be a JSON object"
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def validation_error_response(errors: list[dict]) -> JSONResponse:
    return api_error_response(validation_error(errors))


def add_openai_error_handlers(app) -> None:
    """A server's refusals in the OpenAI shape: an APIError, and the framework's own (an unknown path, a wrong
    method, a body it cannot parse). The router and the workers both install these."""

    async def api_error(_, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    async def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, APIError):  # FastAPI's "error parsing the body", over our 413 while reading it
            return api_error_response(exc.__cause__)
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    async def invalid(_, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    async def client_left(_, exc: ClientDisconnect) -> Response:
        # Gone before its body arrived whole: nobody reads this answer, and it is not the server's error to log.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(ClientDisconnect, client_left)
