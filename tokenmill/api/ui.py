"""The pages the server shows a person: a chat page at `/` and the engine's dashboard at `/dashboard`.

Plain HTML, CSS and JavaScript shipped inside the package (api/static), no build step and nothing fetched from
elsewhere; the pages talk to the server through the same API as any client (`/v1/chat/completions`, `/stats`), so
with an API key they ask for it. The pages themselves hold no secret and need no key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

# Model text reaches the page only as text nodes; the policy is the second line: no inline or foreign script runs.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}


def _static_files() -> list[str]:
    return sorted(f.name for f in resources.files("tokenmill.api").joinpath("static").iterdir()
                  if f.name.endswith(tuple(_TYPES)))


@cache
def _read(name: str) -> bytes:
    return resources.files("tokenmill.api").joinpath("static", name).read_bytes()


def _file_route(name: str) -> Callable[[], Awaitable[Response]]:
    media_type = _TYPES[name[name.rindex("."):]]

    async def serve_file() -> Response:
        return Response(_read(name), media_type=media_type, headers=_HEADERS)

    return serve_file


def ui_routes() -> tuple[APIRouter, set[str]]:
    """The pages' router, and its paths (open: no API key asked for a page, only for what it then fetches)."""
    router = APIRouter()
    paths = {**PAGES, **{f"/ui/{name}": name for name in _static_files()}}
    for path, name in paths.items():
        router.add_api_route(path, _file_route(name), methods=["GET", "HEAD"], include_in_schema=False)
    return router, set(paths)
