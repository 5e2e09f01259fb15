"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}` for every error,
including request-validation errors (HTTP 400, never FastAPI's 422 `{"detail": [...]}`)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class UnsupportedField(ValueError):
    """A bad or unimplemented value of one request field (HTTP 400, param = field)."""

    def __init__(self, field: str, message: str | None = None) -> None:
        super().__init__(message or f"'{field}' is not supported by this server")
        self.field = field


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "request_failed_error",
    503: "service_unavailable",
    500: "internal_server_error",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None, type_: str | None = None
) -> dict:
    """The OpenAI error object; also sent by the ASGI middlewares that answer before FastAPI."""
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type_: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        headers=headers,
        content=error_body(status, message, param=param, code=code, type_=type_),
    )


def model_not_found(model: str, served: str) -> JSONResponse:
    """The 404 for a `model` this server does not serve (one model per server: `served`)."""
    return error_response(
        404,
        f"The model '{model}' does not exist (this server serves '{served}')",
        param="model",
        code="model_not_found",
    )


def error_event(status: int, message: str, *, code: str | None = None) -> str:
    """A stream's last event when it fails after its 200 was sent: the OpenAI error object as
    an SSE `data:` line (the `openai` client raises it as an APIError), then `[DONE]`."""
    return f"data: {json.dumps(error_body(status, message, code=code))}\n\ndata: [DONE]\n\n"


def _union_tag(part) -> bool:
    """pydantic's name of a union branch in an error location ("str", "list[int]",
    "function-after[...]"): not a field the client sent."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    # a union's branches each report an error: a validator's own message (value_error) says most
    err = next((e for e in errs if e.get("type") == "value_error"), errs[0])
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_tag(x)]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('msg', '')}", None
    if err.get("type") == "extra_forbidden":
        field = ".".join(loc)
        return f"unknown field '{field}' (not an OpenAI request field this server accepts)", field
    param = ".".join(loc) or None
    where = f"'{param}': " if param else ""
    return f"{where}{err.get('msg', 'invalid value')}", (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)


async def send_error(
    send, status: int, message: str, *, code: str | None = None, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """An OpenAI error answered straight over ASGI (middlewares that refuse a request before it
    reaches FastAPI: no key, body too large)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
