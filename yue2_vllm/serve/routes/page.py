"""The web page (`/`) and its static files: ES modules, a style sheet and the vendored notation renderer (abcjs, in
static/vendor/ with its licence), served from a fixed set of names with a strict Content-Security-Policy; not part
of the API's OpenAPI document."""
from __future__ import annotations

import base64
import hashlib
import os
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from ..safety import error_response

STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",  # modules need the JS type
                ".txt": "text/plain; charset=utf-8"}
FOLDERS = ("", "vendor/")  # static/ and the third-party code it ships (static/vendor/)
# The inline styles abcjs sets while it draws (its text-measuring SVG, its drag style sheet, the small text of a
# chord symbol's parts), allowed by their hashes: no other inline style applies.
RENDERER_STYLES = ("display: block !important;height: 1px;width: 1px;position: absolute;",
                   ".abcjs-dragging-in-progress text, .abcjs-dragging-in-progress tspan {-webkit-touch-callout: none; "
                   "-webkit-user-select: none; -khtml-user-select: none; -moz-user-select: none; -ms-user-select: "
                   "none; user-select: none;}",
                   "font-size:0.7em")


def style_hashes(styles) -> str:
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()}'"
                    for style in styles)


PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; media-src 'self'; connect-src 'self' blob:; "
                                           "img-src 'self' data:; "
                                           f"style-src 'self' 'unsafe-hashes' {style_hashes(RENDERER_STYLES)}; "
                                           "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
# The page loads nothing from elsewhere (above); audio streams from the server (a signed URL when there is an API
# key), result.json may come from a blob: URL (fetched with the key).
PACKAGE = "yue2_vllm.serve"  # static/ lives beside the serve modules


def page_files() -> dict[str, str]:
    """The page's files (its ES modules, style sheet and vendored code) by name under static/, with their media
    types, as the package holds them."""
    suffixes = {}
    for folder in FOLDERS:
        directory = resources.files(PACKAGE).joinpath("static/" + folder)
        if directory.is_dir():
            suffixes.update({folder + entry.name: os.path.splitext(entry.name)[1] for entry in directory.iterdir()
                             if entry.is_file()})
    return {name: STATIC_TYPES[suffix] for name, suffix in sorted(suffixes.items()) if suffix in STATIC_TYPES}


STATIC = page_files()  # a fixed set of names, never a path


def page_router() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def page():
        html = resources.files(PACKAGE).joinpath("static/index.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @router.get("/static/{name:path}", include_in_schema=False)
    def static(name: str):
        if name not in STATIC:  # a fixed set of files, never a path
            return error_response(404, f"no static file {name!r}")
        data = resources.files(PACKAGE).joinpath(f"static/{name}").read_bytes()
        return Response(data, media_type=STATIC[name], headers=PAGE_HEADERS)

    return router
