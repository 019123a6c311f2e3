"""OpenAI-style error bodies, with the status codes and types vLLM 0.33 answers with.

Owns `APIError` (what a handler raises for a request it refuses), `error_response`, and
`install_handlers`, which makes every failure of a request an
`{"error": {"message", "type", "param", "code"}}` JSON body:

- a body FastAPI cannot validate (not JSON, not an object, a field of the wrong type or
  out of range, a required field missing): 400, type "Bad Request", `param` the field's
  path (`messages[0].content`), the message listing what pydantic found (at most 10),
  as vLLM's validation handler does;
- `APIError`: its own status and type ("BadRequestError" 400 for a request the engine
  cannot run, "NotFoundError" 404 for an unknown model), as vLLM's
  `create_error_response`;
- an unknown route or method: 404 / 405 with the HTTP phrase as the type (a 405 with
  `Allow`, the methods the route serves);
- anything else is a bug: 500 "InternalServerError" with the exception's message, logged
  with its traceback. No bad input reaches it (the tests send every kind they know).

Must never: put a traceback or a file path in a response body.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

__all__ = ["APIError", "error_body", "error_response", "install_handlers"]

_log = logging.getLogger(__name__)
_MAX_REPORTED = 10


class APIError(Exception):
    """A refused request: HTTP `status`, OpenAI error `type`, the offending `param`, and
    response `headers` (a 503's `Retry-After`)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type or {400: "BadRequestError", 404: "NotFoundError"}.get(status, HTTPStatus(status).phrase)
        self.headers = headers


def error_body(message: str, type: str, code: int, param: str | None = None) -> dict:
    """The OpenAI error object (vLLM's `ErrorResponse`)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.status, err.param), status_code=err.status,
                        headers=err.headers)


def _loc(loc: tuple) -> str | None:
    """A pydantic error location as a field path: ("body", "messages", 0, "content") ->
    "messages[0].content"; pydantic's union-branch markers ("list[int]") are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif any(c in str(part) for c in "[](){}") or str(part) in ("str", "int", "list", "dict", "bool", "float"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _validation_message(errors: list[dict]) -> str:
    lines = []
    for e in errors[:_MAX_REPORTED]:
        where = _loc(tuple(e.get("loc", ()))) or "body"
        lines.append(f"  {where}: {e.get('msg', 'invalid')}")
    more = f"\n  ...and {len(errors) - _MAX_REPORTED} more" if len(errors) > _MAX_REPORTED else ""
    label = "error" if len(errors) == 1 else "errors"
    return f"{len(errors)} validation {label}:\n" + "\n".join(lines) + more


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":  # its loc is ("body", character offset)
        loc = errors[0].get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        reason = (errors[0].get("ctx") or {}).get("error", errors[0].get("msg", ""))
        message = f"the request body is not valid JSON{where}: {reason}"
        return JSONResponse(error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400), status_code=400)
    param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
    message = _validation_message(errors) if errors else "Validation error"
    return JSONResponse(error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400, param), status_code=400)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _on_http(request: Request, exc: HTTPException) -> JSONResponse:
    status = exc.status_code
    # Starlette's 405 carries `Allow` (RFC 9110 requires it); keep every header it set.
    return JSONResponse(error_body(str(exc.detail), HTTPStatus(status).phrase, status), status_code=status,
                        headers=exc.headers)


async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
    _log.exception("unhandled error serving %s %s", request.method, request.url.path)
    return JSONResponse(error_body(str(exc) or type(exc).__name__, "InternalServerError", 500), status_code=500)


def install_handlers(app: FastAPI) -> None:
    """Route every failure of `app` through the handlers above."""
    app.add_exception_handler(RequestValidationError, _on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_bug)
