"""The web portal: one static page at ``/`` that talks to the server's own APIs from the browser.

    GET /                  the page (``portal/index.html``)
    GET /portal, GET /ui   redirect to ``/``
    GET /portal/<name>     its script and style sheet

The page has no build step and no library: plain HTML, CSS and one script. Everything it
shows it reads with the key typed into it, from routes any client can call:
``/api/inference/status | logs | usage | activity | up | down`` (the admin key for switching),
``/health``, ``/v1/models`` and ``/v1/chat/completions`` (streamed). The files need no key:
they hold nothing but the page.
"""

from __future__ import annotations

import functools
import pathlib

from quart import Blueprint, Response, redirect

from spark.http.errors import ApiError

bp = Blueprint("portal", __name__)

PORTAL_DIR = pathlib.Path(__file__).with_name("portal")
ASSETS = {"portal.js": "text/javascript; charset=utf-8", "portal.css": "text/css; charset=utf-8"}
# The page runs only its own files: no inline script, no other origin, not framed.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@functools.cache
def _read(name: str) -> bytes:
    return (PORTAL_DIR / name).read_bytes()


def _file(name: str, content_type: str) -> Response:
    return Response(_read(name), content_type=content_type,
                    headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP,
                             "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})


@bp.get("/")
async def index():
    """The portal: active profile, switching, logs, usage, activity and a chat playground."""
    return _file("index.html", "text/html; charset=utf-8")


async def to_index():
    """Another address of the portal: redirects to ``/``."""
    return redirect("/", 302)


for _rule in ("/portal", "/ui"):  # an endpoint each: one operation each in /openapi.json
    bp.add_url_rule(_rule, f"to_index_{_rule[1:]}", to_index, methods=["GET"])


@bp.get("/portal/<name>")
async def asset(name: str):
    """The portal's script and style sheet."""
    content_type = ASSETS.get(name)
    if content_type is None:
        raise ApiError(404, f"the portal has no file {name!r}", code="not_found")
    return _file(name, content_type)
