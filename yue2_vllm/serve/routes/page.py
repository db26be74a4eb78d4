"""The web page (`/`) and its static files: ES modules and a style sheet, served from a fixed set of names with a
strict Content-Security-Policy; not part of the API's OpenAPI document."""
from __future__ import annotations

import os
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from ..safety import error_response

STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}  # modules need the JS type
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; media-src 'self'; connect-src 'self' blob:; "
                                           "img-src 'self' data:; "
                                           "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
# The page loads nothing from elsewhere (above); audio streams from the server (a signed URL when there is an API
# key), result.json may come from a blob: URL (fetched with the key).
PACKAGE = "yue2_vllm.serve"  # static/ lives beside the serve modules


def page_files() -> dict[str, str]:
    """The page's files (its ES modules and style sheet) by name, with their media types, as the package holds them."""
    folder = resources.files(PACKAGE).joinpath("static")
    suffixes = {entry.name: os.path.splitext(entry.name)[1] for entry in folder.iterdir()}
    return {name: STATIC_TYPES[suffix] for name, suffix in sorted(suffixes.items()) if suffix in STATIC_TYPES}


STATIC = page_files()  # a fixed set of names, never a path


def page_router() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def page():
        html = resources.files(PACKAGE).joinpath("static/index.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @router.get("/static/{name}", include_in_schema=False)
    def static(name: str):
        if name not in STATIC:  # a fixed set of files, never a path
            return error_response(404, f"no static file {name!r}")
        data = resources.files(PACKAGE).joinpath(f"static/{name}").read_bytes()
        return Response(data, media_type=STATIC[name], headers=PAGE_HEADERS)

    return router
