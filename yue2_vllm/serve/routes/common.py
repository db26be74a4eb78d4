"""What every router shares: `Api` (the service, the API key and who sent it, the bearer dependency and the 401 it
documents, the JSON answer that hides server paths from callers without the key) and the error handlers that make
every error `{"error": {"status", "message", "field"}}`."""
from __future__ import annotations

import hmac
import json

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ..errors import ServiceError, Unauthorized
from ..safety import error_response, redact, redact_text
from ..service import SongService

BEARER = HTTPBearer(auto_error=False, description="the server's --api-key (or $YUE2_API_KEY)")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="yue2-vllm"'}


class Api:
    """One app's shared state. With an API key every /v1 route and /metrics depend on `authorized` (`auth`) and
    document 401 (`denied`); without one, nothing is guarded and nobody is trusted."""

    def __init__(self, service: SongService, api_key: str | None):
        self.service, self.api_key = service, api_key
        self.guarded = api_key is not None
        self.auth = [Depends(self.authorized)] if self.guarded else []
        self.denied = (401,) if self.guarded else ()

    def trusted(self, request: Request) -> bool:
        """Whether the caller sent the right API key (never, when the server has none)."""
        if self.api_key is None:
            return False
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def authorized(self, request: Request, _=Depends(BEARER)) -> None:
        if self.api_key is not None and not self.trusted(request):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer KEY'", headers=CHALLENGE)

    def answer(self, request: Request, document, status_code: int = 200, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(document if self.trusted(request) else redact(document), status_code=status_code,
                            headers=headers)


def add_error_handlers(app: FastAPI, api: Api) -> None:
    """Every error as `{"error": {"status", "message", "field"}}`: the service's (redacted for callers without the
    key), a request that fails validation (422 naming the field), and Starlette's own (404, 405 with Allow)."""

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        message = exc.message if api.trusted(request) else redact_text(exc.message)
        return error_response(exc.status, message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ())]
        field = location[-1] if len(location) > 1 else None
        if field and location[0] == "header":  # as the header is spelled: Idempotency-Key
            field = "-".join(part.capitalize() for part in field.split("-"))
        return error_response(422, f"{field or 'request'}: {first.get('msg', 'invalid')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of every route at this path, not just the first route's
            methods = set()
            for route in app.router.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                if match != Match.NONE and getattr(route, "methods", None):
                    methods |= set(route.methods)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return error_response(exc.status_code, message, headers=headers or None)
