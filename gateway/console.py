"""``/console``: the web console, static files served as they are (no build step).

The page holds no data, so it is open; what it shows comes from the API with the key the
user gives it. Its Content-Security-Policy allows only this origin's own scripts, styles and
requests: no inline script, no other site, no framing.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

STATIC = Path(__file__).parent / "static" / "console"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)

bp = Blueprint("console", __name__)


@bp.get("/console")
@bp.get("/console/")
def index():
    return send_from_directory(STATIC, "index.html")


@bp.get("/console/<path:name>")
def asset(name: str):
    return send_from_directory(STATIC, name)


@bp.after_request
def _headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"
    return response
