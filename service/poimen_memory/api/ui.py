"""GET /ui: the query explorer, a plain page served by the service itself.

Everything it loads comes from this service (``static/``: one HTML page, one stylesheet,
one script, no build step, no CDN), and the Content-Security-Policy says so to the
browser. The page reads its query from its own URL (``/ui?query=...&project=...``), calls
``GET /memory/query`` and renders results, provenance, plan, timings and degraded stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC", "routes"]

STATIC = Path(__file__).parent / "static"

# Nothing from elsewhere: scripts, styles and fetches are this origin's only.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def explorer(request: Request) -> Response:
    return FileResponse(STATIC / "explorer.html", media_type="text/html", headers=HEADERS)


class _Static(StaticFiles):
    """The page's files, with the page's headers (the page's policy, not the JSON routes')."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


routes = [
    Route("/ui", explorer, methods=["GET"], include_in_schema=False),
    Mount("/ui/static", _Static(directory=STATIC), name="ui-static"),
]
